"""Torch intra-op threads per role: cores go where the work is.

On its own machine a role uses every core it may run on. Under ``relayrl up`` (``RELAYRL_COLOCATED=1``)
the roles share one machine's C cores, and the split follows the loop:

- synchronous (``max_staleness`` 0): generation and training alternate, so each phase may use every
  core: a rollout worker gets C / workers threads, a trainer rank C / nproc;
- overlapped (K >= 1): both phases run at once for part of a step: the workers share ceil(C / 2); the
  trainer ranks take every core (C / nproc each) but wait passively (``OMP_WAIT_POLICY=PASSIVE``: an idle
  OpenMP thread sleeps instead of spinning), so while generation runs the kernel shares the cores between
  the two, and once it is done the trainer has them all. Only the overlapped trainer waits passively: in
  the other roles decode's small kernels would pay the wake-ups.

Generation first while a step streams: a colocated trainer rank that trains a batch's groups as they arrive
(``RelayConfig.streams``) runs at the lowest CPU priority (nice 19, ``RELAYRL_TRAINER_NICE``), so where its
chunks want the cores of the batch's last decode steps the kernel runs the worker and gives the trainer
what is left. It has to be the session's *autogroup*: each role starts in a session of its own (the
launcher's ``start_new_session``, torchrun's for its ranks) and with ``kernel.sched_autogroup_enabled`` CFS
first splits a core evenly between sessions, whatever the threads' nice values say; ``/proc/self/autogroup``
takes the nice of the whole session. Without it a decode step that shares the cores with a training chunk
slows by orders of magnitude: a decode step is many short OpenMP regions, and each waits for whichever of
the worker's threads the kernel has just handed to the trainer. Not done for the other loops: at K = 1 the
trainer's passive threads already give way, and a whole batch's phases alternate; there a niced trainer only
loses the cores to the worker's spinning OpenMP threads after each decode.

An explicit ``rollout.threads`` / ``trainer.threads`` overrides the count; a wait policy or trainer nice already
in the environment is kept (``RELAYRL_TRAINER_NICE=0``: the trainer keeps its priority).

Pinned roles (``rollout.cpus``, ``trainer.cpus``: ``relayrl/runtime/cpus.py``) count their own CPUs, C being the size of
their list. Workers and trainer pinned to disjoint CPUs do not share cores: each role takes all of its own
(C / workers, C / nproc) whatever the loop, and the trainer neither waits passively nor yields (nothing runs
beside it), as on separate machines.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Literal

from relayrl.config import ConfigError, RelayConfig
from relayrl.runtime.cpus import check_available, format_cpu_list, parse_cpu_list, pin_process

log = logging.getLogger(__name__)

COLOCATED_ENV = "RELAYRL_COLOCATED"
TRAINER_NICE_ENV = "RELAYRL_TRAINER_NICE"
COLOCATED_TRAINER_NICE = 19  # the lowest priority: the trainer takes only the cores generation leaves
AUTOGROUP = Path("/proc/self/autogroup")  # this session's CPU share (kernel CONFIG_SCHED_AUTOGROUP)
Role = Literal["rollout", "trainer"]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def role_cpus(cfg: RelayConfig, role: Role) -> tuple[int, ...] | None:
    """The CPUs ``role`` is pinned to (``rollout.cpus`` / ``trainer.cpus``), None when it is not."""
    text = cfg.rollout.cpus if role == "rollout" else cfg.trainer.cpus
    return parse_cpu_list(text) if text is not None else None


def shares_cores(cfg: RelayConfig) -> bool:
    """Whether the workers and the trainer may run on the same cores: not when both are pinned, disjointly."""
    rollout, trainer = role_cpus(cfg, "rollout"), role_cpus(cfg, "trainer")
    return rollout is None or trainer is None or bool(set(rollout) & set(trainer))


def available_role_cpus(cfg: RelayConfig, role: Role) -> tuple[int, ...] | None:
    """``role_cpus``, or ConfigError naming the key when one of them is not available to this process."""
    cpus = role_cpus(cfg, role)
    if cpus is not None:
        try:
            check_available(cpus)
        except ValueError as err:
            raise ConfigError(f"{role}.cpus: {err}") from None
    return cpus


def check_role_cpus(cfg: RelayConfig) -> None:
    """``available_role_cpus`` of both roles (``relayrl up`` checks before it starts anything)."""
    for role in ("rollout", "trainer"):
        available_role_cpus(cfg, role)


def pin_role(cfg: RelayConfig, role: Role) -> tuple[int, ...] | None:
    """Pin this process to ``role``'s CPUs, if it has any (call it at the role's start); returns them."""
    cpus = available_role_cpus(cfg, role)
    if cpus is not None:
        pin_process(cpus)
        log.info("%s pinned to CPUs %s (%s.cpus)", role, format_cpu_list(cpus), role)
    return cpus


def torch_threads(cfg: RelayConfig, role: Role, *, cores: int | None = None, colocated: bool | None = None) -> int:
    """Threads for one process of ``role`` by the rule in the module docstring."""
    configured = cfg.rollout.threads if role == "rollout" else cfg.trainer.threads
    if configured != "auto":
        return configured
    pinned = role_cpus(cfg, role)
    cores = cores or (len(pinned) if pinned is not None else available_cores())
    if colocated is None:
        colocated = os.environ.get(COLOCATED_ENV) == "1"
    if not colocated:
        return cores
    processes = cfg.rollout.workers if role == "rollout" else cfg.trainer.nproc
    if role == "rollout" and cfg.controller.max_staleness > 0 and shares_cores(cfg):
        cores = -(-cores // 2)  # overlapped beside the trainer: the workers share half
    return max(1, cores // processes)


def trainer_env(cfg: RelayConfig) -> dict[str, str]:
    """The OpenMP environment of a trainer started beside its rollout workers (module docstring)."""
    env = {"OMP_NUM_THREADS": str(torch_threads(cfg, "trainer", colocated=True))}
    if not shares_cores(cfg):
        return env
    if cfg.controller.max_staleness > 0 and "OMP_WAIT_POLICY" not in os.environ:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if cfg.streams and TRAINER_NICE_ENV not in os.environ:
        env[TRAINER_NICE_ENV] = str(COLOCATED_TRAINER_NICE)
    return env


def yield_cores_to_generation() -> int:
    """Lower this process to the nice in ``RELAYRL_TRAINER_NICE`` (module docstring): the calling thread (the
    threads it starts inherit it) and, where the kernel has them, its session's autogroup. Call it before the
    process starts its threads. Returns the nice applied, 0 when the variable is unset or 0."""
    raw = os.environ.get(TRAINER_NICE_ENV, "0")
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ConfigError(f"{TRAINER_NICE_ENV}: {raw!r} is not a nice value from 0 to 19")
    if nice == 0:
        return 0
    os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    with contextlib.suppress(OSError):  # no autogroups in this kernel: the threads' nice is what counts
        AUTOGROUP.write_text(str(nice))
    log.info("beside the rollout workers: this trainer rank runs at nice %d, generation first", nice)
    return nice
