"""Dispatch prompts to rollout workers by load, collect whole groups, re-dispatch on failure.

A prompt's group is complete when all ``n`` samples arrived from one worker. When a worker fails
mid-stream (dead, cancelled, deadline, version refused) the prompts whose groups are incomplete are
sent again, to any worker, up to ``max_attempts`` times; after that they are reported as failed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import grpc

from relayrl.controller.latency import LatencyHistogram
from relayrl.controller.workers import WorkerHandle, WorkerRegistry
from relayrl.rollout.sampling import SamplingParams
from relayrl.v1 import common_pb2, rollout_pb2

log = logging.getLogger(__name__)


@dataclass
class PromptJob:
    prompt_id: str
    token_ids: list[int]
    attempts: int = 0


@dataclass
class DispatchResult:
    groups: dict[str, list[common_pb2.Completion]] = field(default_factory=dict)  # prompt id -> n samples
    failed: dict[str, str] = field(default_factory=dict)  # prompt id -> reason
    seconds: float = 0.0


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        chunk_size: int,
        generate_timeout_s: float,
        max_attempts: int = 3,
        max_threads: int = 32,
    ) -> None:
        self.registry = registry
        self.chunk_size = chunk_size
        self.generate_timeout_s = generate_timeout_s
        self.max_attempts = max_attempts
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="dispatch")
        self.generate_seconds = LatencyHistogram()  # each Generate call, from its start to its stream's end

    def run(
        self,
        prompts: Sequence[PromptJob],
        params: SamplingParams,
        *,
        min_version: int = 0,
        on_group: Callable[[str, list[common_pb2.Completion]], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        no_worker_timeout_s: float = 600.0,
    ) -> DispatchResult:
        """Generate ``params.n`` samples for every prompt; blocks until each group is complete or failed.

        ``on_group(prompt_id, samples)`` is called (from a dispatch thread) as each group completes.
        """
        start = time.monotonic()
        result = DispatchResult()
        pending: deque[list[PromptJob]] = deque(
            list(prompts[i : i + self.chunk_size]) for i in range(0, len(prompts), self.chunk_size)
        )
        running: dict[Future, tuple[list[PromptJob], WorkerHandle]] = {}
        idle_since = time.monotonic()
        while pending or running:
            if should_stop():
                for chunk, _ in running.values():
                    pending.append(chunk)
                for chunk in pending:
                    for job in chunk:
                        result.failed[job.prompt_id] = "stopped before generation finished"
                break
            while pending:
                worker = self.registry.acquire(min_version)
                if worker is None:
                    break
                chunk = pending.popleft()
                future = self._pool.submit(self._generate_chunk, worker, chunk, params, min_version, on_group)
                running[future] = (chunk, worker)
            if self.registry.paused:  # a paused run is not idle: its prompts wait for Resume
                idle_since = time.monotonic()
            if not running:
                if time.monotonic() - idle_since > no_worker_timeout_s:
                    for chunk in pending:
                        for job in chunk:
                            result.failed[job.prompt_id] = f"no rollout worker at version >= {min_version}"
                    break
                self.registry.wait_for_change(0.2)
                continue
            idle_since = time.monotonic()
            done, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                chunk, worker = running.pop(future)
                self.registry.release(worker)
                groups, error = future.result()
                if error.startswith("UNAVAILABLE") and f"worker {worker.worker_id} is" not in error:
                    # unreachable, not merely paused/draining (those answer "worker <id> is ..."): stop choosing
                    # it; a live worker's next heartbeat re-adds it
                    self.registry.remove(worker.worker_id)
                result.groups.update(groups)
                retry = [job for job in chunk if job.prompt_id not in groups]
                for job in retry:
                    job.attempts += 1
                    if job.attempts >= self.max_attempts:
                        result.failed[job.prompt_id] = f"{self.max_attempts} attempts failed, last: {error}"
                if retry := [job for job in retry if job.prompt_id not in result.failed]:
                    log.warning("re-dispatching %d prompts after %s on %s", len(retry), error, worker.worker_id)
                    pending.append(retry)
        result.seconds = time.monotonic() - start
        return result

    def _generate_chunk(
        self,
        worker: WorkerHandle,
        chunk: list[PromptJob],
        params: SamplingParams,
        min_version: int,
        on_group: Callable[[str, list[common_pb2.Completion]], None] | None,
    ) -> tuple[dict[str, list[common_pb2.Completion]], str]:
        """Stream one Generate call; returns the complete groups and the error that ended it, if any."""
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.PromptInput(prompt_id=j.prompt_id, token_ids=j.token_ids) for j in chunk],
            params=params.to_proto(),
            min_policy_version=min_version,
        )
        samples: dict[str, list[common_pb2.Completion]] = {j.prompt_id: [] for j in chunk}
        error = ""
        started = time.monotonic()
        try:
            call = worker.stub.Generate(request, timeout=self.generate_timeout_s)
        except ValueError as err:  # its channel was closed: the worker was removed after it was acquired
            return {}, f"UNAVAILABLE: worker removed ({err})"
        with self.registry.lock:
            worker.calls.add(call)
        try:
            for completion in call:
                if completion.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    error = "aborted by the worker"
                    continue
                group = samples[completion.prompt_id]
                group.append(completion)
                if on_group is not None and len(group) == params.n:
                    on_group(completion.prompt_id, group)
        except grpc.RpcError as err:
            error = f"{err.code().name}: {err.details()}"
        finally:
            with self.registry.lock:
                worker.calls.discard(call)
            self.generate_seconds.observe(time.monotonic() - started)
        complete = {pid: group for pid, group in samples.items() if len(group) == params.n}
        return complete, error
