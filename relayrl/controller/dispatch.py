"""Dispatch prompts to rollout workers by load, collect whole groups, re-dispatch on failure.

A prompt's group is complete when all ``n`` samples arrived from one worker. When a worker fails
mid-stream (dead, cancelled, deadline, version refused) the prompts whose groups are incomplete are
sent again, to any worker, up to ``max_attempts`` times; after that they are reported as failed.

Stragglers: once nothing waits to be sent, a chunk in flight longer than ``straggler_factor`` x the median
duration of the recent chunks is also sent to an idle worker. Each prompt's first complete group wins
(claimed once, so no group is kept twice); when one call has delivered the chunk, the other is cancelled.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from relayrl.client.workers import WorkerHandle, WorkerRegistry
from relayrl.controller.latency import LatencyHistogram
from relayrl.errors import rpc_error_text
from relayrl.runtime.repeats import RepeatedWarning
from relayrl.v1 import common_pb2, rollout_pb2
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class PromptJob:
    prompt_id: str
    token_ids: list[int]
    attempts: int = 0


@dataclass
class Attempt:
    """One Generate call for a chunk; ``twin`` is the other call for the same chunk (straggler copy)."""

    chunk: list[PromptJob]
    worker: WorkerHandle
    started: float = field(default_factory=time.monotonic)
    twin: Attempt | None = None
    call: grpc.Call | None = None
    cancelled: bool = False


class GroupClaims:
    """Each prompt's first complete group wins; ``on_group`` hears only the winners."""

    def __init__(self, on_group: Callable[[str, list[common_pb2.Completion]], None] | None) -> None:
        self.on_group = on_group
        self.won: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, prompt_id: str, group: list[common_pb2.Completion]) -> bool:
        with self._lock:
            if prompt_id in self.won:
                return False
            self.won.add(prompt_id)
        if self.on_group is not None:
            self.on_group(prompt_id, group)
        return True


@dataclass
class DispatchResult:
    groups: dict[str, list[common_pb2.Completion]] = field(default_factory=dict)  # prompt id -> n samples
    failed: dict[str, str] = field(default_factory=dict)  # prompt id -> reason
    seconds: float = 0.0
    aborted: int = 0  # completions a worker ended as "abort" (their prompts were sent again)


def call_seed(seed: int, prompt_ids: Sequence[str]) -> int:
    """A seeded run's seed for one Generate call: blake2b of ``seed`` and the call's prompt ids, in [0, 2**31) (an
    int32 in every engine). A draw's prompt id is unique in a run ("epoch:row"), so calls draw apart, while the same
    prompts sent again draw as before (a retry or a straggler's copy of fewer draws anew); the engine mixes in each
    row's prompt and sample index."""
    key = "\0".join([str(seed), *prompt_ids]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 1


def _finished(futures: queue.SimpleQueue[Future], timeout: float) -> list[Future]:
    """The futures done so far: waits up to ``timeout`` for the first (none: []), then takes what else is there.
    O(1) per future, where ``concurrent.futures.wait`` visits every running one each time."""
    try:
        done = [futures.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            done.append(futures.get_nowait())
        except queue.Empty:
            return done


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        chunk_size: int,
        generate_timeout_s: float,
        max_attempts: int = 3,
        max_threads: int = 32,
        straggler_factor: float = 3.0,
    ) -> None:
        self.registry = registry
        self.chunk_size = chunk_size
        self.generate_timeout_s = generate_timeout_s
        self.max_attempts = max_attempts
        self.straggler_factor = straggler_factor  # 0: never send a chunk twice
        self.chunk_seconds: deque[float] = deque(maxlen=32)  # durations of recent complete chunks
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="dispatch")
        self.generate_seconds = LatencyHistogram()  # each Generate call, from its start to its stream's end
        self.repeats = RepeatedWarning(log)  # a slow worker is a straggler step after step: once every 10

    def run(
        self,
        prompts: Sequence[PromptJob],
        params: SamplingParams,
        *,
        min_version: int = 0,
        on_group: Callable[[str, list[common_pb2.Completion]], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        no_worker_timeout_s: float = 600.0,
        only: frozenset[str] | None = None,
    ) -> DispatchResult:
        """Generate ``params.n`` samples for every prompt; blocks until each group is complete or failed.

        ``on_group(prompt_id, samples)`` is called (from a dispatch thread) as each group completes.
        ``only``: send to these worker ids alone (None: any worker).
        """
        start = time.monotonic()
        result = DispatchResult()
        claims = GroupClaims(on_group)
        pending: deque[list[PromptJob]] = deque(
            list(prompts[i : i + self.chunk_size]) for i in range(0, len(prompts), self.chunk_size)
        )
        running: dict[Future, Attempt] = {}
        finished: queue.SimpleQueue[Future] = queue.SimpleQueue()  # each future of ``running`` once, when done
        submit = functools.partial(self._submit, running, finished, params, min_version, claims)
        idle_since = time.monotonic()
        while pending or running:
            if should_stop():
                for attempt in running.values():
                    self._cancel(attempt)
                    pending.append(attempt.chunk)
                for chunk in pending:
                    for job in chunk:
                        result.failed[job.prompt_id] = "stopped before generation finished"
                break
            while pending:
                worker = self.registry.acquire(min_version, only=only)
                if worker is None:
                    break
                submit(Attempt(pending.popleft(), worker))
            if not pending:
                self._copy_stragglers(running, claims, submit, min_version, only)
            if self.registry.paused:  # a paused run is not idle: its prompts wait for Resume
                idle_since = time.monotonic()
            if not running:
                if time.monotonic() - idle_since > no_worker_timeout_s:
                    for chunk in pending:
                        for job in chunk:
                            result.failed[job.prompt_id] = f"no rollout worker at version >= {min_version}" + (
                                f" among {sorted(only)}" if only is not None else ""
                            )
                    break
                self.registry.wait_for_change(0.2)
                continue
            idle_since = time.monotonic()
            for future in _finished(finished, timeout=0.2):
                attempt = running.pop(future)
                self.registry.release(attempt.worker)
                groups, error, aborted = future.result()
                result.groups.update(groups)
                result.aborted += aborted
                if attempt.cancelled:
                    continue  # its twin delivered the chunk
                if not error:
                    self.chunk_seconds.append(time.monotonic() - attempt.started)
                if error.startswith("UNAVAILABLE") and f"worker {attempt.worker.worker_id} is" not in error:
                    # unreachable, not merely paused/draining (those answer "worker <id> is ..."): stop choosing
                    # it; a live worker's next heartbeat re-adds it
                    self.registry.remove(attempt.worker.worker_id)
                retry = [job for job in attempt.chunk if job.prompt_id not in claims.won]
                if (twin := attempt.twin) is not None and not twin.cancelled:
                    twin.twin = None  # the other call now answers for the chunk alone
                    if not retry:
                        self._cancel(twin)
                    continue
                for job in retry:
                    job.attempts += 1
                    if job.attempts >= self.max_attempts:
                        result.failed[job.prompt_id] = f"{self.max_attempts} attempts failed, last: {error}"
                if retry := [job for job in retry if job.prompt_id not in result.failed]:
                    log.warning("re-dispatching %d prompts after %s on %s", len(retry), error, attempt.worker.worker_id)
                    pending.append(retry)
        result.seconds = time.monotonic() - start
        return result

    def _submit(
        self,
        running: dict[Future, Attempt],
        finished: queue.SimpleQueue[Future],
        params: SamplingParams,
        min_version: int,
        claims: GroupClaims,
        attempt: Attempt,
    ) -> None:
        future = self._pool.submit(self._generate_chunk, attempt, params, min_version, claims)
        running[future] = attempt
        future.add_done_callback(finished.put)

    def _copy_stragglers(
        self,
        running: dict[Future, Attempt],
        claims: GroupClaims,
        submit: Callable[[Attempt], None],
        min_version: int,
        only: frozenset[str] | None = None,
    ) -> None:
        """Send each chunk in flight longer than straggler_factor x the recent median to an idle worker too."""
        if self.straggler_factor <= 0 or len(self.chunk_seconds) < 3:
            return
        limit = self.straggler_factor * statistics.median(self.chunk_seconds)
        now = time.monotonic()
        for attempt in list(running.values()):
            if attempt.twin is not None or attempt.cancelled or now - attempt.started <= limit:
                continue
            rest = [job for job in attempt.chunk if job.prompt_id not in claims.won]
            if not rest:
                continue
            worker = self.registry.acquire(min_version, idle_other_than=attempt.worker, only=only)
            if worker is None:
                return
            copy = Attempt(rest, worker, twin=attempt)
            attempt.twin = copy
            self.repeats.warn(
                f"straggler {attempt.worker.worker_id}",
                "%s has had %d prompts for %.1fs (> %.0fx the median chunk): also sending them to %s",
                attempt.worker.worker_id, len(rest), now - attempt.started, self.straggler_factor, worker.worker_id,
            )  # fmt: skip
            submit(copy)

    def _cancel(self, attempt: Attempt) -> None:
        with self.registry.lock:
            attempt.cancelled = True
            if attempt.call is not None:
                attempt.call.cancel()

    def _generate_chunk(
        self, attempt: Attempt, params: SamplingParams, min_version: int, claims: GroupClaims
    ) -> tuple[dict[str, list[common_pb2.Completion]], str, int]:
        """Stream one Generate call; returns the groups it completed first (claimed), the error that ended it, if
        any, and how many completions the worker aborted."""
        if params.seed is not None:
            params = dataclasses.replace(params, seed=call_seed(params.seed, [j.prompt_id for j in attempt.chunk]))
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.PromptInput(prompt_id=j.prompt_id, token_ids=j.token_ids) for j in attempt.chunk],
            params=params.to_proto(),
            min_policy_version=min_version,
            renews_registration=True,
            whole_groups=True,  # only complete groups count: a group's rows travel together, not one by one
        )
        worker = attempt.worker
        samples: dict[str, list[common_pb2.Completion]] = {j.prompt_id: [] for j in attempt.chunk}
        won: dict[str, list[common_pb2.Completion]] = {}
        error, aborted = "", 0
        started = time.monotonic()
        try:
            call = worker.stub.Generate(request, timeout=self.generate_timeout_s)
        except ValueError as err:  # its channel was closed: the worker was removed after it was acquired
            return {}, f"UNAVAILABLE: worker removed ({err})", 0
        with self.registry.lock:
            worker.calls.add(call)
            attempt.call = call
            if attempt.cancelled:
                call.cancel()
        try:
            for completion in (c for response in call for c in response.completions):
                if completion.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    error = "aborted by the worker"
                    aborted += 1
                    continue
                group = samples[completion.prompt_id]
                group.append(completion)
                if len(group) == params.n and claims.claim(completion.prompt_id, group):
                    won[completion.prompt_id] = group
            worker.last_seen = time.monotonic()  # answered in full: this call was its heartbeat
        except grpc.RpcError as err:
            error = rpc_error_text(err)
        finally:
            with self.registry.lock:
                worker.calls.discard(call)
            self.generate_seconds.observe(time.monotonic() - started)
        return won, error, aborted
