"""``RelayClient``: the synchronous Python SDK of ControllerService.

Every call has a deadline (``timeout``, default ``options.timeout_s``) that covers its retries: a call
failing with a retryable code is tried again under the one retry policy (relayrl/rpc/retry.py: UNAVAILABLE and
DEADLINE_EXCEEDED of one try), with exponential backoff, up to ``options.attempts`` times, while time is left.
Other errors (INVALID_ARGUMENT, NOT_FOUND, ...) raise ``grpc.RpcError`` at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import grpc

from relayrl.client.options import ClientOptions
from relayrl.client.types import Completion, Prompt, SubmitProgress, as_prompts, submit_request
from relayrl.v1 import controller_pb2, controller_pb2_grpc
from relayrl.wire.sampling import SamplingParams

T = TypeVar("T")
MAX_PROMPTS_PER_CALL = 256


class RelayClient:
    """``RelayClient(address=None, token=None, ...)``: address from the argument (``host:port``, or a run directory
    ``relayrl up`` started: ``RelayClient("runs/NAME")`` reads its ``controller.address``) or RELAYRL_CONTROLLER,
    token from the argument or RELAYRL_AUTH_TOKEN; see ClientOptions.resolve for TLS and retries."""

    def __init__(self, address: str | Path | None = None, *, options: ClientOptions | None = None, **settings) -> None:
        self.options = options or ClientOptions.resolve(address, **settings)
        self._channel = self.options.open_channel(grpc)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------------
    def _call(self, method: Callable[..., T], request, timeout: float | None) -> T:
        return self.options.retry().call(
            lambda left: method(request, timeout=left, metadata=self.options.metadata()),
            deadline_s=timeout or self.options.timeout_s,
        )

    # -- clients ---------------------------------------------------------------------------------
    def submit(
        self,
        prompts: Iterable[str | Prompt | Mapping],
        params: SamplingParams | None = None,
        *,
        reward_fn: str = "",
        raw: bool = False,
        timeout: float | None = None,
    ) -> Iterator[Completion]:
        """Sample ``params.n`` completions per prompt; yields each as soon as its group is complete.

        Prompts go out in calls of at most 256. A stream broken by UNAVAILABLE is resumed for the
        prompts whose samples did not all arrive (no sample is yielded twice)."""
        params = params or SamplingParams()
        deadline = time.monotonic() + (timeout or self.options.submit_timeout_s)
        items = as_prompts(prompts)
        for start in range(0, len(items), MAX_PROMPTS_PER_CALL):
            yield from self._submit_chunk(items[start : start + MAX_PROMPTS_PER_CALL], params, reward_fn, raw, deadline)

    def _submit_chunk(self, prompts, params, reward_fn, raw, deadline) -> Iterator[Completion]:
        progress = SubmitProgress(prompts, params.n)
        policy = self.options.retry()
        waits = policy.waits()
        while progress.open:
            request = submit_request(progress.open.values(), params, reward_fn, raw)
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                for message in self.stub.SubmitPrompts(request, timeout=remaining, metadata=self.options.metadata()):
                    completion = Completion.from_proto(message)
                    if progress.accept(completion):
                        yield completion
                return
            except grpc.RpcError as err:
                wait = policy.next_wait(err, waits, deadline)
                if wait is None:
                    raise
                time.sleep(wait)

    # -- operators -------------------------------------------------------------------------------
    def status(self, *, timeout: float | None = None) -> controller_pb2.StatusResponse:
        return self._call(self.stub.Status, controller_pb2.StatusRequest(), timeout)

    def weights_status(self, *, timeout: float | None = None) -> controller_pb2.WeightsStatusResponse:
        return self._call(self.stub.WeightsStatus, controller_pb2.WeightsStatusRequest(), timeout)

    def pause(self, reason: str = "", *, timeout: float | None = None) -> controller_pb2.PauseRunResponse:
        return self._call(self.stub.Pause, controller_pb2.PauseRunRequest(reason=reason), timeout)

    def unpause(self, *, timeout: float | None = None) -> controller_pb2.ResumeRunResponse:
        """Undo ``pause``: the run goes on (``relayrl unpause``; the RPC is ``Resume``). Resuming a stopped run is
        ``relayrl up --resume``, not this."""
        return self._call(self.stub.Resume, controller_pb2.ResumeRunRequest(), timeout)

    def drain(self, worker_id: str, *, timeout: float | None = None) -> controller_pb2.DrainWorkerResponse:
        return self._call(self.stub.DrainWorker, controller_pb2.DrainWorkerRequest(worker_id=worker_id), timeout)

    def scale_rollout(self, replicas: int, *, timeout: float | None = None) -> controller_pb2.ScaleRolloutResponse:
        return self._call(self.stub.ScaleRollout, controller_pb2.ScaleRolloutRequest(replicas=replicas), timeout)

    def scale_scorer(
        self, name: str, replicas: int, *, timeout: float | None = None
    ) -> controller_pb2.ScaleScorerResponse:
        """Set the desired server count of scorer ``name`` (``relayrl scale reward``); ``relayrl up`` actuates it."""
        request = controller_pb2.ScaleScorerRequest(name=name, replicas=replicas)
        return self._call(self.stub.ScaleScorer, request, timeout)

    def sync_weights(self, force: bool = False, *, timeout: float | None = None) -> controller_pb2.SyncWeightsResponse:
        return self._call(self.stub.SyncWeights, controller_pb2.SyncWeightsRequest(force=force), timeout)

    def wait_for_sync(
        self, sync_request_id: int, *, timeout: float = 120.0, poll_s: float = 0.5
    ) -> controller_pb2.WeightsStatusResponse:
        """Poll WeightsStatus until the trainer reported ``sync_request_id`` handled; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            weights = self.weights_status()
            if weights.sync_request_handled >= sync_request_id:
                return weights
            if time.monotonic() + poll_s > deadline:
                raise TimeoutError(f"weight sync request {sync_request_id} not handled within {timeout:.0f}s")
            time.sleep(poll_s)
