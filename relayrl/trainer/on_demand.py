"""Weight syncs between training steps (trainer rank 0): operator requests and newly joined workers.

A daemon thread reads the controller's WeightSyncPlan every ``interval_s`` and pushes the weights
of the last step again when
- an operator asked for it (SyncWeights; ``force`` drops the broadcast group so that it is re-formed):
  to every worker;
- a worker is behind and this trainer has not pushed the current version to it (it joined after a
  scale-up, at version 0, or restarted): to those workers only, so they serve from the next dispatch
  instead of idling until the next step's sync (the controller never hands them work before).
A push sends what the last step sent (its kind: "full", or a LoRA run's "adapter", which brings the base weights
staged by ``stage_base`` to a worker that lacks them). Each push is reported with ReportWeightSync. Pushes and the
loop's per-step gather + publish share one lock, so a push never reads a half-gathered arena. Cost: the publisher's
arena (one CPU copy of the weights on rank 0, where each step's gather lands) is what pushes send between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import torch

from relayrl.runtime.words import counted
from relayrl.trainer.sync import SyncResult, WeightPublisher
from relayrl.v1 import controller_pb2, controller_pb2_grpc
from relayrl.weightsync.arena import WeightArena
from relayrl.weightsync.manifest import Spec

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 60.0


class OnDemandSync:
    """Wraps the WeightPublisher of rank 0: ``publish`` for steps, a thread for everything in between."""

    def __init__(
        self,
        publisher: WeightPublisher,
        controller: controller_pb2_grpc.ControllerServiceStub,
        interval_s: float = 1.0,
    ) -> None:
        self.publisher = publisher
        self.controller = controller
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self._weights: WeightArena | None = None
        self._kind = "full"
        self._version = 0
        self._pushed: dict[str, int] = {}  # worker id -> the version this trainer last brought it to
        self._retry_at: dict[str, tuple[float, float]] = {}  # joiner that failed -> (next try, backoff)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="on-demand-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def publish(
        self,
        version: int,
        specs: Sequence[Spec],
        gather: Callable[[Mapping[str, torch.Tensor]], None],
        kind: str = "full",
    ) -> SyncResult:
        """The per-step publish (every live worker): ``gather(views)`` fills the publisher's arena for
        ``specs`` (of ``kind``), which is then sent and remembered for later pushes."""
        with self.lock:
            arena = self.publisher.arena_for(specs, kind)
            gather(dict(arena.views()))
            result = self.publisher.publish(version, arena, kind=kind)
            self._weights, self._version, self._kind = arena, version, kind
            self._remember(result)
        return result

    def stage_base(self, specs: Sequence[Spec], gather: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        """LoRA: ``gather(views)`` fills the publisher's arena of the frozen base weights, once per run; adapter
        updates bring it to the workers that lack it."""
        with self.lock:
            gather(dict(self.publisher.arena_for(specs, "base").views()))

    def _remember(self, result: SyncResult) -> None:
        for worker_id in result.synced:
            self._pushed[worker_id] = result.version
            self._retry_at.pop(worker_id, None)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except grpc.RpcError as err:
                log.warning("on-demand weight sync: controller %s: %s", err.code().name, err.details())
            except Exception:  # keep the thread alive; the next step's sync covers the workers anyway
                log.exception("on-demand weight sync failed")

    def poll_once(self) -> SyncResult | None:
        """One look at the plan; pushes and reports when needed. Returns what was pushed, if anything."""
        plan = self.controller.GetWeightSyncPlan(
            controller_pb2.GetWeightSyncPlanRequest(version=self._version), timeout=10
        )
        if plan.sync_request_id:
            return self._push(None, "operator-force" if plan.force else "operator", plan.sync_request_id, plan.force)
        now = time.monotonic()
        joiners = {
            w.worker_id
            for w in plan.workers
            if w.policy_version < self._version
            and self._pushed.get(w.worker_id) != self._version
            and self._retry_at.get(w.worker_id, (0.0, 0.0))[0] <= now
        }
        if joiners and self._weights is not None:
            return self._push(joiners, "joiners", 0, False)
        return None

    def _push(self, only: set[str] | None, reason: str, request_id: int, force: bool) -> SyncResult | None:
        with self.lock:
            if self._weights is None:  # no step yet: every worker loaded version 0 from the model path
                result = SyncResult(self._version, 0.0, [], {}, "", 0)
            else:
                if force:
                    self.publisher.close()
                result = self.publisher.publish(self._version, self._weights, only=only, kind=self._kind)
                self._remember(result)
        if only is not None:
            for worker_id in only - set(result.synced):
                _, backoff = self._retry_at.get(worker_id, (0.0, self.interval_s))
                self._retry_at[worker_id] = (time.monotonic() + backoff, min(2 * backoff, MAX_BACKOFF_S))
        log.info(
            "weight push v%d (%s): %s in %.2fs%s",
            result.version, reason, counted(len(result.synced), "worker"), result.seconds,
            f", left out {sorted(result.failed)}" if result.failed else "",
        )  # fmt: skip
        self.controller.ReportWeightSync(
            controller_pb2.ReportWeightSyncRequest(
                policy_version=result.version,
                seconds=result.seconds,
                synced_worker_ids=result.synced,
                failed=result.failed,
                sync_request_id=request_id,
                reason=reason,
            ),
            timeout=30,
        )
        return result
