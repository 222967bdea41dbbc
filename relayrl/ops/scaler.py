"""Scaling ``relayrl up``'s local rollout processes to the controller's desired replica count.

The launcher calls ``tick()`` from its watch loop. Scale-up starts ``rollout-<k>`` (lowest free k):
the worker registers at version 0, the controller hands it no training work below the batch's
required version, and the trainer pushes it the current weights within about a second
(relayrl.trainer.on_demand). Scale-down drains the highest-numbered workers first (DrainWorker: no new
work, in-flight calls finish), then sends SIGTERM once they have nothing in flight (or after
``drain_timeout_s``; the worker deregisters and any call it still had is re-dispatched). A worker an
operator drained (``relayrl drain rollout-k``: draining in Status, or gone and listed in Status.drained_workers)
is stopped the same way and its slot given up, as a scale-down gives it up: the desired count becomes the
workers left, and its id is never started again by this launcher. A worker process that exited makes the next
tick look at once, before the supervisor would restart it.
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
        self.given_up: set[str] = set()  # roles an operator drained: stopped, never started again
        self._next_tick = 0.0

    def workers(self) -> list[int]:
        """Indices of running rollout processes that are not being drained."""
        indices = [int(m.group(1)) for role in self.job.children if (m := ROLE.match(role))]
        return sorted(k for k in indices if f"rollout-{k}" not in self.draining)

    def _exited(self) -> bool:
        """A rollout process of ours has exited and is not being stopped by us."""
        return any(
            ROLE.match(role) and role not in self.draining and proc.poll() is not None
            for role, proc in self.job.children.items()
        )

    def tick(self) -> None:
        if time.monotonic() < self._next_tick and not self._exited():
            return
        self._next_tick = time.monotonic() + self.interval_s
        try:
            status = self.stub.Status(controller_pb2.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return  # the controller is checked for liveness elsewhere
        desired = self._give_up_drained(status)  # the count it set, if it set one: ``status`` predates it
        self._stop_drained(status)
        running = self.workers()
        if desired <= 0 or desired == len(running):
            return
        if desired > len(running):
            taken = {int(m.group(1)) for role in [*self.job.children, *self.given_up] if (m := ROLE.match(role))}
            free = (k for k in range(len(taken) + desired) if k not in taken)
            for k in [next(free) for _ in range(desired - len(running))]:
                self.on_change(f"scale up: starting rollout-{k}")
                self.spawn(k)
        else:
            for k in running[desired:]:
                self._drain(f"rollout-{k}")

    def _give_up_drained(self, status: controller_pb2.StatusResponse) -> int:
        """Workers of ours an operator drained: stopped once idle (``_stop_drained``) and their slots given up, the
        desired count lowered by them (``ScaleRollout``; at least 1, which it then starts anew). Returns the desired
        count from then on: the one it set, else the one in ``status`` (which predates any it sets)."""
        desired = status.desired_rollout_replicas
        drained = {w.worker_id for w in status.workers if w.state == "draining"} | set(status.drained_workers)
        roles = sorted(r for r in drained if r in self.job.children and ROLE.match(r) and r not in self.draining)
        if not roles:
            return desired
        for role in roles:
            self.draining[role] = time.monotonic() + self.drain_timeout_s
            self.given_up.add(role)
        left = max(1, desired - len(roles) if desired > 0 else len(self.workers()))
        try:
            self.stub.ScaleRollout(controller_pb2.ScaleRolloutRequest(replicas=left), timeout=5)
        except grpc.RpcError as err:
            log.warning("ScaleRollout(%d) after a drain: %s", left, err.code().name)
        self.on_change(
            f"drain: {', '.join(roles)} drained by an operator: stopped once idle and not restarted "
            f"(its slot is given up); desired rollout replicas now {left}"
        )
        return left

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
