"""CPU seconds of a process tree by role, sampled from /proc while it runs (Linux).

A role is one direct child of the root process (``relayrl up`` starts the controller, each rollout worker
and the trainer launcher as its children) with everything below it; the root itself is ``launcher``.
CPU seconds = utime + stime of every live process in the role (children that already exited and were
reaped count through their parent's cutime + cstime).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.runtime.procs import child_pids, command_line, descendants

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROLE_MARKERS = (("controller serve", "controller"), ("rollout serve", "rollout"), ("trainer", "trainer"))


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` (/proc/<pid>/stat fields 14-17); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces; fields after it are fixed
    return sum(int(v) for v in fields[11:15]) / CLOCK_TICKS


def role_of(pid: int) -> str:
    """``controller``, ``rollout``, ``trainer`` (from the command line of a ``relayrl up`` child), else ``other``."""
    with contextlib.suppress(OSError):
        cmdline = command_line(pid)
        for marker, role in ROLE_MARKERS:
            if marker in cmdline:
                return role
    return "other"


def tree_cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` (``launcher``) and of each role below it, roles of one kind summed."""
    totals = {"launcher": cpu_seconds(root)}
    for child in child_pids(root):
        role = role_of(child)
        totals[role] = totals.get(role, 0.0) + sum(cpu_seconds(p) for p in [child, *descendants(child)])
    return totals


@dataclass
class CpuSampler:
    """Samples ``tree_cpu_by_role(root)`` every ``interval_s`` on a thread: (epoch time, {role: cpu s})."""

    root: int
    interval_s: float = 0.5
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), tree_cpu_by_role(self.root)))
            self._stop.wait(self.interval_s)

    def usage(self, start: float, end: float) -> tuple[float, dict[str, float]]:
        """(wall seconds, {role: CPU seconds}) between the first and last samples inside [start, end]."""
        times = [t for t, _ in self.samples]
        first = bisect.bisect_left(times, start)
        last = bisect.bisect_right(times, end) - 1
        if first >= last:
            return 0.0, {}
        before, after = self.samples[first][1], self.samples[last][1]
        return times[last] - times[first], {role: max(0.0, after[role] - before.get(role, 0.0)) for role in after}
