"""CPU pinning of a role (``rollout.cpus``, ``trainer.cpus``): which cores its processes run on.

A CPU list is the kernel's format (``cpuset(7)``, ``taskset -c``, ``/proc/<pid>/status: Cpus_allowed_list``):
comma-separated CPU numbers and inclusive ranges, ``"0-3,8"``. A role pins itself when it starts, every thread of
its process (``sched_setaffinity`` of each task in ``/proc/self/task``; threads started later inherit it), so
under ``relayrl up`` the roles can be given disjoint cores, as on separate machines, or one NUMA node each. Every
trainer rank pins itself (``trainer run``), under torchrun too, to the whole list: the kernel places the ranks
within it. A pinned role's ``auto`` torch threads count those CPUs (``relayrl/cores/threads.py``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The sorted CPUs of ``"0-3,8"``; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a CPU number or range (a CPU list looks like '0-3,8')")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"range {part.strip()!r} ends before it starts")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | frozenset[int] | set[int]) -> str:
    """The shortest CPU list of ``cpus``: (0, 1, 2, 3, 8) -> "0-3,8"."""
    ordered, runs = sorted(cpus), []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def check_available(cpus: tuple[int, ...]) -> None:
    """ValueError when a CPU of ``cpus`` is not one this process may use (its affinity, a cgroup's cpuset, or a
    CPU the machine lacks)."""
    allowed = os.sched_getaffinity(0)
    missing = set(cpus) - allowed
    if missing:
        raise ValueError(
            f"CPU {format_cpu_list(missing)} is not available here (this process may use {format_cpu_list(allowed)})"
        )


def pin_process(cpus: tuple[int, ...]) -> None:
    """Run every thread of this process on ``cpus`` (which ``check_available`` passed: else OSError)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)
