"""A controller and rollout workers as local processes on loopback, without a trainer: what load tests and
fuzz tests run against. Logs go to ``<logs>/<role>.log``; everything is stopped on exit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relayrl.config import load_config
from relayrl.launcher import LocalJob, controller_status, wait_until
from relayrl.runtime.ports import free_port


@dataclass(frozen=True)
class LocalCluster:
    job: LocalJob
    controller: str  # host:port
    workers: tuple[str, ...]  # rollout worker addresses, in worker-id order

    @property
    def controller_pid(self) -> int:
        return self.job.children["controller"].pid


@contextlib.contextmanager
def local_cluster(config_path: Path, workers: int, logs: Path, timeout_s: float = 180) -> Iterator[LocalCluster]:
    """Start ``relayrl controller serve`` and ``workers`` x ``relayrl rollout serve`` with ``config_path``, all at
    once (a worker retries its registration until the controller answers: its imports and model load need not wait
    for the controller's start); yields once every worker is registered."""
    logs.mkdir(parents=True, exist_ok=True)
    job = LocalJob(load_config(config_path), config_path, logs)
    common = ["--config", str(config_path)]
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        job.spawn("controller", job.relay("controller", "serve", *common, "--port", str(port)))
        roles = [f"rollout-{i}" for i in range(workers)]
        for role in roles:
            job.spawn(role, job.relay("rollout", "serve", *common, "--controller", address, "--worker-id", role))
        wait_until(
            lambda: len(controller_status(address).workers) >= workers,
            timeout_s,
            f"{workers} rollout workers to register",
            job,
            ["controller", *roles],
        )
        registered = sorted(controller_status(address).workers, key=lambda w: w.worker_id)
        yield LocalCluster(job, address, tuple(w.address for w in registered))
    finally:
        job.stop(grace_s=10)
