"""Torch intra-op threads per role: cores go where the work is.

On its own machine a role uses every core it may run on. Under ``relayrl up`` (``RELAYRL_COLOCATED=1``)
the roles share one machine's C cores, and the split follows the loop:

- synchronous (``max_staleness`` 0): generation and training alternate, so each phase may use every
  core: a rollout worker gets C / workers threads, a trainer rank C / nproc;
- overlapped (K >= 1): both phases run at once, so they split the cores: the workers share ceil(C / 2),
  the trainer ranks the rest (at least one thread each).

An explicit ``rollout.threads`` / ``trainer.threads`` overrides the rule.
"""

from __future__ import annotations

import os
from typing import Literal

from relayrl.config import RelayConfig

COLOCATED_ENV = "RELAYRL_COLOCATED"
Role = Literal["rollout", "trainer"]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def torch_threads(cfg: RelayConfig, role: Role, *, cores: int | None = None, colocated: bool | None = None) -> int:
    """Threads for one process of ``role`` by the rule in the module docstring."""
    configured = cfg.rollout.threads if role == "rollout" else cfg.trainer.threads
    if configured != "auto":
        return configured
    cores = cores or available_cores()
    if colocated is None:
        colocated = os.environ.get(COLOCATED_ENV) == "1"
    if not colocated:
        return cores
    processes = cfg.rollout.workers if role == "rollout" else cfg.trainer.nproc
    if cfg.controller.max_staleness > 0:
        rollout_cores = -(-cores // 2)
        cores = rollout_cores if role == "rollout" else max(1, cores - rollout_cores)
    return max(1, cores // processes)
