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
(``RelayConfig.streams``) runs at the lowest CPU priority (nice 19, ``RELAYRL_TRAINER_NICE``) while that batch
is being generated, so where its chunks want the cores of the batch's last decode steps the kernel runs the
worker and gives the trainer what is left. It has to be the session's *autogroup*: each role starts in a
session of its own (the launcher's ``start_new_session``, torchrun's for each rank) and with
``kernel.sched_autogroup_enabled`` CFS first splits a core evenly between sessions, whatever the threads' nice
values say; ``/proc/self/autogroup`` takes the nice of the whole session. Without it a decode step that shares
the cores with a training chunk slows by orders of magnitude: a decode step is many short OpenMP regions, and
each waits for whichever of the worker's threads the kernel has just handed to the trainer.

Only while the batch is being generated (``GenerationFirst``): from the start of a streamed step until its
stream's last part is read, then back to the session's own nice for the rest of the step (the chunks still to
train, the optimizer steps, the weight sync). A session at nice 19 gets ~1/70 of a core that any other nice-0
session wants, so a trainer niced for the whole run is starved by whatever else runs on the machine (another
job, an editor, a test suite) long after its workers went idle. Raising an autogroup's nice back to 0 needs no
privilege (only a negative nice does); a thread's does, so where the kernel has no autogroups the threads run
at nice 19 for the whole run, as the only way to yield there.

Not done for the other loops: at K = 1 the trainer's passive threads already give way, and a whole batch's
phases alternate; there a niced trainer only loses the cores to the worker's spinning OpenMP threads after
each decode.

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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from relayrl.config import ConfigError, RelayConfig
from relayrl.runtime.cpus import check_available, format_cpu_list, parse_cpu_list, pin_process

log = logging.getLogger(__name__)

COLOCATED_ENV = "RELAYRL_COLOCATED"
TRAINER_NICE_ENV = "RELAYRL_TRAINER_NICE"
COLOCATED_TRAINER_NICE = 19  # the lowest priority: the trainer takes only the cores generation leaves
AUTOGROUP = Path("/proc/self/autogroup")  # this session's CPU share (kernel CONFIG_SCHED_AUTOGROUP)
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
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


def evals_first(cfg: RelayConfig, *, colocated: bool | None = None) -> bool:
    """Whether the trainer waits for the held-out evals before it takes a batch: under ``relayrl up`` at K = 0 with
    the workers and the trainer on the same cores. There a rollout worker decodes on every core, so an eval that
    generates while a step trains slows both by several times (each of decode's many short OpenMP regions waits for
    whichever thread the kernel handed to the trainer); alone, one after the other, each runs at full speed. The
    eval of v runs beside the generation of the batch trained from v (the engine batches both), and the trainer
    takes that batch once the eval is done (``Controller.pull_batch``)."""
    if colocated is None:
        colocated = os.environ.get(COLOCATED_ENV) == "1"
    return colocated and cfg.controller.max_staleness == 0 and shares_cores(cfg)


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


class GenerationFirst:
    """A streaming trainer's priority beside its rollout workers (module docstring): ``generating`` lowers the
    autogroups of ``pids`` (this host's trainer ranks) to nice ``nice``, ``generated`` puts back the nice each had.
    Both do nothing unless ``scoped`` (a nice to apply and a kernel with autogroups)."""

    def __init__(self, nice: int = 0, *, scoped: bool = False, pids: Sequence[int] = ()) -> None:
        self.nice, self.scoped = nice, scoped and nice > 0
        self.own = {pid: autogroup_nice(pid) for pid in pids or [os.getpid()]} if self.scoped else {}

    def for_ranks(self, pids: Sequence[int]) -> GenerationFirst:
        """The same, applied to the autogroups of ``pids`` (rank 0: every rank on its host)."""
        return GenerationFirst(self.nice, scoped=self.scoped, pids=pids)

    def generating(self) -> None:
        """The step's batch is being generated: its workers first."""
        self._set(lambda own: max(own, self.nice))

    def generated(self) -> None:
        """The batch is complete: each session back to its own nice."""
        self._set(lambda own: own)

    def _set(self, nice_of) -> None:
        for pid, own in self.own.items():
            try:
                autogroup_path(pid).write_text(str(nice_of(own)))
            except OSError as err:  # a rank that exited: its run is ending
                log.debug("autogroup of pid %d: %s", pid, err)


def autogroup_path(pid: int) -> Path:
    return AUTOGROUP if pid == os.getpid() else Path(f"/proc/{pid}/autogroup")


def autogroup_nice(pid: int) -> int:
    """The nice of ``pid``'s autogroup ("/autogroup-N nice K")."""
    return int(autogroup_path(pid).read_text().split()[-1])


def autogroups() -> bool:
    """Whether CFS splits the cores between sessions first (``kernel.sched_autogroup_enabled`` = 1)."""
    try:
        return AUTOGROUP.exists() and AUTOGROUP_ENABLED.read_text().strip() == "1"
    except OSError:
        return False


def yield_cores_to_generation() -> GenerationFirst:
    """This trainer's ``GenerationFirst`` from the nice in ``RELAYRL_TRAINER_NICE`` (module docstring); call it
    before the process starts its threads. With autogroups it changes nothing yet (the trainer loop calls
    ``generating`` / ``generated`` around each streamed step's generation); without them the calling thread (the
    threads it starts inherit it) takes that nice for the whole run. Unset or 0: nothing, ever."""
    raw = os.environ.get(TRAINER_NICE_ENV, "0")
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ConfigError(f"{TRAINER_NICE_ENV}: {raw!r} is not a nice value from 0 to 19")
    if nice == 0:
        return GenerationFirst()
    if autogroups():
        log.info("beside the rollout workers: this trainer's session runs at nice %d while a batch generates", nice)
        return GenerationFirst(nice, scoped=True)
    os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    log.info("beside the rollout workers: this trainer rank runs at nice %d (no autogroups: for the run)", nice)
    return GenerationFirst(nice)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 for the block, then as they were: for a trainer's start-up work (forwards of a
    few tokens in the probes, the optimizer state's creation), which gains little from more threads and, beside a
    process that takes every core (a rollout worker loading or generating), waits in OpenMP's barriers for the
    threads the kernel handed to it."""
    import torch  # here, not at the top: the launcher imports this module and never torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
