"""Scaling ``relayrl up``'s local rollout processes to the controller's desired replica count.

The launcher calls ``tick()`` from its watch loop. Scale-up starts ``rollout-<k>`` (lowest free k):
the worker registers at version 0, the controller hands it no training work below the batch's
required version, and the trainer pushes it the current weights within about a second
(relayrl.trainer.on_demand). Scale-down drains the highest-numbered workers first (DrainWorker: no new
work, in-flight calls finish), then sends SIGTERM once they have nothing in flight (or after
``drain_timeout_s``; the worker deregisters and any call it still had is re-dispatched). A worker an
operator drained (``relayrl drain rollout-k``) is stopped the same way, and replaced when a desired count
is set.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import grpc

from relayrl.v1 import controller_pb2

log = logging.getLogger(__name__)
ROLE = re.compile(r"^rollout-(\d+)$")


class LocalScaler:
    """``job``: the launcher's LocalJob; ``spawn(k)`` starts worker ``rollout-k``; ``stub``: ControllerService."""

    def __init__(
        self,
        job,
        spawn: Callable[[int], None],
        stub,
        *,
        interval_s: float = 1.0,
        drain_timeout_s: float = 120.0,
        on_change: Callable[[str], None] = log.info,
    ) -> None:
        self.job, self.spawn, self.stub = job, spawn, stub
        self.interval_s, self.drain_timeout_s = interval_s, drain_timeout_s
        self.on_change = on_change
        self.draining: dict[str, float] = {}  # role -> SIGTERM deadline
        self._next_tick = 0.0

    def workers(self) -> list[int]:
        """Indices of running rollout processes that are not being drained."""
        indices = [int(m.group(1)) for role in self.job.children if (m := ROLE.match(role))]
        return sorted(k for k in indices if f"rollout-{k}" not in self.draining)

    def tick(self) -> None:
        if time.monotonic() < self._next_tick:
            return
        self._next_tick = time.monotonic() + self.interval_s
        try:
            status = self.stub.Status(controller_pb2.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return  # the controller is checked for liveness elsewhere
        for w in status.workers:  # drained by an operator: stop it once idle, like our own
            if w.state == "draining" and w.worker_id in self.job.children and ROLE.match(w.worker_id):
                self.draining.setdefault(w.worker_id, time.monotonic() + self.drain_timeout_s)
        self._stop_drained(status)
        desired, running = status.desired_rollout_replicas, self.workers()
        if desired <= 0 or desired == len(running):
            return
        if desired > len(running):
            taken = {int(m.group(1)) for role in self.job.children if (m := ROLE.match(role))}
            free = (k for k in range(len(taken) + desired) if k not in taken)
            for k in [next(free) for _ in range(desired - len(running))]:
                self.on_change(f"scale up: starting rollout-{k}")
                self.spawn(k)
        else:
            for k in running[desired:]:
                self._drain(f"rollout-{k}")

    def _drain(self, role: str) -> None:
        self.on_change(f"scale down: draining {role}")
        try:
            self.stub.DrainWorker(controller_pb2.DrainWorkerRequest(worker_id=role), timeout=5)
            self.draining[role] = time.monotonic() + self.drain_timeout_s
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                self.draining[role] = 0.0  # not registered (yet): nothing in flight, stop it now
            else:
                log.warning("DrainWorker(%s): %s; retrying", role, err.code().name)  # at the next tick

    def _stop_drained(self, status: controller_pb2.StatusResponse) -> None:
        in_flight = {w.worker_id: w.in_flight for w in status.workers}
        now = time.monotonic()
        for role, deadline in list(self.draining.items()):
            if in_flight.get(role, 0) == 0 or now > deadline:
                self.on_change(f"scale down: stopping {role} ({in_flight.get(role, 0)} calls in flight)")
                self.job.stop([role])
                del self.job.children[role]
                del self.draining[role]
