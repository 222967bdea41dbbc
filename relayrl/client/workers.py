"""Registry of rollout workers: liveness by heartbeat, versions, load, and the gRPC stubs."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc.experimental import ChannelOptions

from relayrl.rpc.channels import open_channel
from relayrl.v1 import rollout_pb2_grpc

READY, DRAINING, DEAD = "ready", "draining", "dead"
# Generate streams are read on the calling (dispatch) thread, not handed over by the channel's spin thread
WORKER_CHANNEL_OPTIONS = [(ChannelOptions.SingleThreadedUnaryStream, 1)]


@dataclass
class WorkerHandle:
    worker_id: str
    address: str
    engine: str
    channel: grpc.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    policy_version: int = 0
    state: str = READY
    last_seen: float = field(default_factory=time.monotonic)  # its last heartbeat or fully answered dispatch
    in_flight: int = 0
    last_dispatch: float = 0.0  # monotonic time of the last Generate handed to it
    calls: set = field(default_factory=set)  # live Generate calls, cancelled when the worker dies
    tokens_per_second: float = 0.0
    generated_tokens: int = 0  # from the worker's Stats (polled)


class WorkerRegistry:
    """Workers register and heartbeat with RegisterWorker (a dispatch answered in full counts as a beat);
    silence beyond ``timeout_s`` means dead."""

    def __init__(self, timeout_s: float, max_in_flight: int = 2, channel_options: list | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._channel_options = [*(channel_options or []), *WORKER_CHANNEL_OPTIONS]
        self._workers: dict[str, WorkerHandle] = {}  # registration order
        # acquire's order, every worker in exactly one: never given a call (registration order), then the others
        # least recently given a call first (each call moves its worker to the end)
        self._never_called: dict[str, WorkerHandle] = {}
        self._by_last_call: dict[str, WorkerHandle] = {}
        self._rotation = 0  # where the next ``rotation`` slice starts
        self.lock = threading.Condition()
        self.paused = False  # an operator paused the run: nothing is handed out

    def register(self, worker_id: str, address: str, engine: str, policy_version: int, state: str = READY) -> None:
        """Add or refresh a worker. A worker that comes back after being declared dead re-joins here. Waiters
        are woken only by a change (a plain heartbeat of a large fleet would otherwise wake them all the time)."""
        with self.lock:
            handle = self._workers.get(worker_id)
            changed = handle is None or handle.address != address
            if changed:
                if handle is not None:
                    handle.channel.close()
                channel = open_channel(address, self._channel_options)
                handle = WorkerHandle(worker_id, address, engine, channel, rollout_pb2_grpc.RolloutServiceStub(channel))
                self._workers[worker_id] = handle
                self._by_last_call.pop(worker_id, None)  # a new process at a new address: as if it just joined
                self._never_called.pop(worker_id, None)
                self._never_called[worker_id] = handle
            handle.last_seen = time.monotonic()
            changed = changed or handle.policy_version != policy_version
            handle.policy_version = policy_version
            if (handle.state != DRAINING or state == DRAINING) and handle.state != state:
                handle.state, changed = state, True
            if changed:
                self.lock.notify_all()

    def heartbeat_interval_s(self, heartbeats_per_s: float) -> float:
        """Seconds between one worker's heartbeats so that the fleet sends about ``heartbeats_per_s``:
        max(1, workers / heartbeats_per_s), at most a third of the timeout (a worker misses two beats before
        it is dropped)."""
        return min(max(1.0, len(self._workers) / heartbeats_per_s), self.timeout_s / 3)

    def remove(self, worker_id: str) -> WorkerHandle | None:
        with self.lock:
            handle = self._workers.pop(worker_id, None)
            self._never_called.pop(worker_id, None)
            self._by_last_call.pop(worker_id, None)
            if handle is not None:
                handle.state = DEAD
                for call in list(handle.calls):
                    call.cancel()
                handle.channel.close()
            self.lock.notify_all()
            return handle

    def reap(self) -> list[str]:
        """Remove workers silent for longer than the timeout; returns their ids."""
        now = time.monotonic()
        with self.lock:
            dead = [w.worker_id for w in self._workers.values() if now - w.last_seen > self.timeout_s]
        for worker_id in dead:
            self.remove(worker_id)
        return dead

    def set_versions(self, worker_ids: list[str], version: int, *, exact: bool = False) -> None:
        """Record that workers loaded ``version`` (never lowering a known version unless ``exact``)."""
        with self.lock:
            for worker_id in worker_ids:
                if worker_id in self._workers:
                    known = self._workers[worker_id].policy_version
                    self._workers[worker_id].policy_version = version if exact else max(known, version)
            self.lock.notify_all()

    def set_state(self, worker_id: str, state: str) -> bool:
        with self.lock:
            if worker_id not in self._workers:
                return False
            self._workers[worker_id].state = state
            self.lock.notify_all()
            return True

    def set_paused(self, paused: bool) -> None:
        with self.lock:
            self.paused = paused
            self.lock.notify_all()

    def get(self, worker_id: str) -> WorkerHandle | None:
        with self.lock:
            return self._workers.get(worker_id)

    def acquire(
        self,
        min_version: int,
        *,
        idle_other_than: WorkerHandle | None = None,
        only: frozenset[str] | None = None,
    ) -> WorkerHandle | None:
        """The least-loaded ready worker at ``min_version`` or newer with a free slot (least recently used
        among equals: never-called workers first, in the order they joined); its load is taken. With
        ``idle_other_than``: only a worker with nothing in flight that is not that one (a straggler's chunk goes
        there too). With ``only``: one of those worker ids. None while the registry is paused.

        Workers are visited least recently called first, so the first idle candidate is the answer: O(1) while
        the fleet has idle workers, one pass when every candidate is busy."""
        with self.lock:
            if self.paused:
                return None
            worker = None
            for w in itertools.chain(self._never_called.values(), self._by_last_call.values()):
                if (
                    w.state != READY
                    or w.policy_version < min_version
                    or w.in_flight >= self.max_in_flight
                    or (only is not None and w.worker_id not in only)
                    or (idle_other_than is not None and (w.in_flight or w.worker_id == idle_other_than.worker_id))
                ):
                    continue
                if worker is None or w.in_flight < worker.in_flight:
                    worker = w
                    if not w.in_flight:
                        break
            if worker is None:
                return None
            worker.in_flight += 1
            worker.last_dispatch = time.monotonic()
            self._never_called.pop(worker.worker_id, None)
            self._by_last_call.pop(worker.worker_id, None)
            self._by_last_call[worker.worker_id] = worker
            return worker

    def release(self, worker: WorkerHandle) -> None:
        with self.lock:
            worker.in_flight -= 1
            self.lock.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        with self.lock:
            self.lock.wait(timeout)

    def __len__(self) -> int:
        with self.lock:
            return len(self._workers)

    def snapshot(self) -> list[WorkerHandle]:
        with self.lock:
            return list(self._workers.values())

    def rotation(self, limit: int) -> list[WorkerHandle]:
        """Up to ``limit`` workers, each call continuing where the last one stopped (registration order), so
        that polling every worker costs at most ``limit`` calls per round however large the fleet."""
        with self.lock:
            workers = list(self._workers.values())
            if len(workers) <= limit:
                return workers
            start = self._rotation % len(workers)
            self._rotation = start + limit
            return (workers + workers)[start : start + limit]

    def ready_ids(self, min_version: int) -> set[str]:
        """Ids of the ready workers at ``min_version`` or newer."""
        with self.lock:
            return {w.worker_id for w in self._workers.values() if w.state == READY and w.policy_version >= min_version}

    def active(self) -> list[WorkerHandle]:
        """Workers that should receive weights: every live worker, draining ones included."""
        with self.lock:
            return [w for w in self._workers.values() if w.state != DEAD]
