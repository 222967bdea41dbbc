"""``AsyncRelayClient``: the asyncio (grpc.aio) Python SDK of ControllerService.

Same contract as RelayClient: per-call deadlines that cover retries, the one retry policy (relayrl/rpc/retry.py)
with exponential backoff up to ``options.attempts`` times, SubmitPrompts resumed without duplicates.
Create it inside a running event loop (grpc.aio channels bind to the loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path

import grpc
from grpc import aio

from relayrl.client.options import ClientOptions
from relayrl.client.sync import MAX_PROMPTS_PER_CALL
from relayrl.client.types import Completion, Prompt, SubmitProgress, as_prompts, submit_request
from relayrl.v1 import controller_pb2, controller_pb2_grpc
from relayrl.wire.sampling import SamplingParams


class AsyncRelayClient:
    """``AsyncRelayClient(address=None, token=None, ...)``, the address as ``RelayClient``'s (``host:port`` or a run
    directory); use ``async with`` or ``await close()``."""

    def __init__(self, address: str | Path | None = None, *, options: ClientOptions | None = None, **settings) -> None:
        self.options = options or ClientOptions.resolve(address, **settings)
        self._channel = self.options.open_channel(aio)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncRelayClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()

    # -- plumbing --------------------------------------------------------------------------------
    async def _call(self, method: Callable, request, timeout: float | None):
        return await self.options.retry().call_async(
            lambda left: method(request, timeout=left, metadata=self.options.metadata()),
            deadline_s=timeout or self.options.timeout_s,
        )

    # -- clients ---------------------------------------------------------------------------------
    async def submit(
        self,
        prompts: Iterable[str | Prompt | Mapping],
        params: SamplingParams | None = None,
        *,
        reward_fn: str = "",
        raw: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[Completion]:
        """Sample ``params.n`` completions per prompt; yields each as soon as its group is complete."""
        params = params or SamplingParams()
        deadline = time.monotonic() + (timeout or self.options.submit_timeout_s)
        items = as_prompts(prompts)
        for start in range(0, len(items), MAX_PROMPTS_PER_CALL):
            progress = SubmitProgress(items[start : start + MAX_PROMPTS_PER_CALL], params.n)
            async for completion in self._submit_chunk(progress, params, reward_fn, raw, deadline):
                yield completion

    async def _submit_chunk(self, progress: SubmitProgress, params, reward_fn, raw, deadline):
        policy = self.options.retry()
        waits = policy.waits()
        while progress.open:
            request = submit_request(progress.open.values(), params, reward_fn, raw)
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                call = self.stub.SubmitPrompts(request, timeout=remaining, metadata=self.options.metadata())
                async for message in call:
                    completion = Completion.from_proto(message)
                    if progress.accept(completion):
                        yield completion
                return
            except grpc.RpcError as err:
                wait = policy.next_wait(err, waits, deadline)
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    # -- operators -------------------------------------------------------------------------------
    async def status(self, *, timeout: float | None = None) -> controller_pb2.StatusResponse:
        return await self._call(self.stub.Status, controller_pb2.StatusRequest(), timeout)

    async def weights_status(self, *, timeout: float | None = None) -> controller_pb2.WeightsStatusResponse:
        return await self._call(self.stub.WeightsStatus, controller_pb2.WeightsStatusRequest(), timeout)

    async def pause(self, reason: str = "", *, timeout: float | None = None) -> controller_pb2.PauseRunResponse:
        return await self._call(self.stub.Pause, controller_pb2.PauseRunRequest(reason=reason), timeout)

    async def unpause(self, *, timeout: float | None = None) -> controller_pb2.ResumeRunResponse:
        """Undo ``pause``: the run goes on (``relayrl unpause``; the RPC is ``Resume``). Resuming a stopped run is
        ``relayrl up --resume``, not this."""
        return await self._call(self.stub.Resume, controller_pb2.ResumeRunRequest(), timeout)

    async def drain(self, worker_id: str, *, timeout: float | None = None) -> controller_pb2.DrainWorkerResponse:
        request = controller_pb2.DrainWorkerRequest(worker_id=worker_id)
        return await self._call(self.stub.DrainWorker, request, timeout)

    async def scale_rollout(
        self, replicas: int, *, timeout: float | None = None
    ) -> controller_pb2.ScaleRolloutResponse:
        request = controller_pb2.ScaleRolloutRequest(replicas=replicas)
        return await self._call(self.stub.ScaleRollout, request, timeout)

    async def scale_scorer(
        self, name: str, replicas: int, *, timeout: float | None = None
    ) -> controller_pb2.ScaleScorerResponse:
        """``RelayClient.scale_scorer`` in asyncio."""
        request = controller_pb2.ScaleScorerRequest(name=name, replicas=replicas)
        return await self._call(self.stub.ScaleScorer, request, timeout)

    async def sync_weights(
        self, force: bool = False, *, timeout: float | None = None
    ) -> controller_pb2.SyncWeightsResponse:
        return await self._call(self.stub.SyncWeights, controller_pb2.SyncWeightsRequest(force=force), timeout)

    async def wait_for_sync(
        self, sync_request_id: int, *, timeout: float = 120.0, poll_s: float = 0.5
    ) -> controller_pb2.WeightsStatusResponse:
        """Poll WeightsStatus until the trainer reported ``sync_request_id`` handled; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            weights = await self.weights_status()
            if weights.sync_request_handled >= sync_request_id:
                return weights
            if time.monotonic() + poll_s > deadline:
                raise TimeoutError(f"weight sync request {sync_request_id} not handled within {timeout:.0f}s")
            await asyncio.sleep(poll_s)
