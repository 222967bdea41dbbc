"""Episode turns on the rollout workers: ``TurnDispatcher.generate(token_ids, max_tokens, affinity)`` (asyncio).

A turn is one row: the episode's token ids so far as the prompt (``PromptInput.token_ids``), ``n`` = 1. Turns
waiting at the same moment go to a worker together, as one Generate call of many rows (``whole_groups`` off:
each row comes back as soon as it finishes), so the engine batches them with every other call it holds. Workers
are taken from the controller's registry (``acquire``: ready, at the batch's version, a free call slot), so
episode turns and other Generate calls share the same accounting.

Affinity: a turn goes to the worker of its episode's previous turn while that worker is ready (an engine with a
prefix cache then prefills only the new tokens, and the episode's samples all carry one worker id); a turn whose
worker is gone or not ready goes to any worker. A call that fails (the worker died, a deadline, a pause-mode
weight load aborting its rows) sends its unfinished turns again, to any worker, up to ``max_attempts``
times; a turn that waits ``no_worker_timeout_s`` with no worker to take it (an unpaused run) fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import grpc

from relayrl.client.workers import WorkerHandle, WorkerRegistry
from relayrl.episodes.loop import GenerationFailed
from relayrl.errors import rpc_error_text
from relayrl.rpc.channels import open_aio_channel
from relayrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from relayrl.wire.sampling import SamplingParams


@dataclass
class _Turn:
    token_ids: list[int]
    max_tokens: int
    affinity: str
    future: asyncio.Future
    attempts: int = 0
    queued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Route:
    """Where a round's turns may go: workers at ``min_version`` or newer, only ``only`` (None: any)."""

    min_version: int = 0
    only: frozenset[str] | None = None


class TurnDispatcher:
    """Sends turns to workers (module docstring). Create and use it on one event loop."""

    def __init__(
        self,
        registry: WorkerRegistry,
        params: SamplingParams,
        *,
        generate_timeout_s: float,
        max_rows_per_call: int,
        max_attempts: int = 3,
        no_worker_timeout_s: float = 600.0,
    ) -> None:
        self.registry = registry
        self.params = dataclasses.replace(params, n=1)
        self.generate_timeout_s = generate_timeout_s
        self.max_rows_per_call = max_rows_per_call
        self.max_attempts = max_attempts
        self.no_worker_timeout_s = no_worker_timeout_s
        self.route = Route()
        self.aborted = 0  # turn rows a worker ended as "abort" (sent again): a counter over the dispatcher's life
        self._pending: list[_Turn] = []
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._stubs: dict[tuple[str, str], tuple[grpc.aio.Channel, rollout_pb2_grpc.RolloutServiceStub, tuple]] = {}

    async def generate(self, token_ids: list[int], max_tokens: int, affinity: str = "") -> common_pb2.Completion:
        """The completion of one turn (``GenerationFailed`` when every attempt failed)."""
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        turn = _Turn(list(token_ids), max_tokens, affinity, asyncio.get_running_loop().create_future())
        self._pending.append(turn)
        self._wake.set()
        return await turn.future

    async def close(self) -> None:
        """Cancel the calls in flight and close the channels."""
        for task in [self._pump_task, *self._calls]:
            if task is not None:
                task.cancel()
        for channel, _, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()

    async def _pump(self) -> None:
        while True:
            self._wake.clear()
            self._pending = [t for t in self._pending if not t.future.done()]  # cancelled episodes
            if self._pending:
                self._dispatch()
                self._expire()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.05 if self._pending else None)

    def _dispatch(self) -> None:
        """Hand every waiting turn to a worker with a free slot, affinity first, in calls of up to
        ``max_rows_per_call`` rows of equal ``max_tokens``."""
        route = self.route
        ready = self.registry.ready_ids(route.min_version)
        if route.only is not None:
            ready &= route.only
        queues: dict[tuple[str, int], list[_Turn]] = {}
        for turn in self._pending:
            if turn.affinity not in ready:
                turn.affinity = ""
            queues.setdefault((turn.affinity, turn.max_tokens), []).append(turn)
        sent: set[int] = set()
        for (affinity, max_tokens), turns in sorted(queues.items(), key=lambda kv: kv[0][0] == ""):
            while turns:
                only = frozenset({affinity}) if affinity else route.only
                worker = self.registry.acquire(route.min_version, only=only)
                if worker is None:
                    break
                chunk, turns = turns[: self.max_rows_per_call], turns[self.max_rows_per_call :]
                sent |= {id(t) for t in chunk}
                task = asyncio.get_running_loop().create_task(self._call(worker, chunk, max_tokens, route))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)
        self._pending = [t for t in self._pending if id(t) not in sent]

    def _expire(self) -> None:
        """Fail turns that waited ``no_worker_timeout_s`` with no worker (never while the run is paused)."""
        now = time.monotonic()
        if self.registry.paused:
            for turn in self._pending:
                turn.queued = now
            return
        for turn in self._pending:
            if now - turn.queued > self.no_worker_timeout_s and not turn.future.done():
                only = f" among {sorted(self.route.only)}" if self.route.only is not None else ""
                turn.future.set_exception(
                    GenerationFailed(f"no rollout worker at version >= {self.route.min_version}{only}")
                )

    def _stub(self, worker: WorkerHandle) -> tuple[rollout_pb2_grpc.RolloutServiceStub, tuple]:
        key = (worker.worker_id, worker.address)
        if key not in self._stubs:
            channel, metadata = open_aio_channel(worker.address)
            self._stubs[key] = (channel, rollout_pb2_grpc.RolloutServiceStub(channel), metadata)
        _, stub, metadata = self._stubs[key]
        return stub, metadata

    async def _call(self, worker: WorkerHandle, turns: list[_Turn], max_tokens: int, route: Route) -> None:
        """One Generate call for ``turns``; unfinished ones are sent again (or failed) when it ends."""
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.PromptInput(prompt_id=str(i), token_ids=t.token_ids) for i, t in enumerate(turns)],
            params=dataclasses.replace(self.params, max_tokens=max_tokens).to_proto(),
            min_policy_version=route.min_version,
            renews_registration=True,
        )
        error = ""
        try:
            stub, metadata = self._stub(worker)
            async for response in stub.Generate(request, timeout=self.generate_timeout_s, metadata=metadata):
                for completion in response.completions:
                    turn = turns[int(completion.prompt_id)]
                    if completion.finish_reason == common_pb2.FINISH_REASON_ABORT:
                        error = "aborted by the worker"
                        self.aborted += 1
                    elif not turn.future.done():
                        turn.future.set_result(completion)
            worker.last_seen = time.monotonic()  # answered in full: a heartbeat
        except grpc.RpcError as err:
            error = rpc_error_text(err)
        finally:
            self.registry.release(worker)
        if error.startswith("UNAVAILABLE") and f"worker {worker.worker_id} is" not in error:
            self.registry.remove(worker.worker_id)  # unreachable (not merely paused/draining): a heartbeat re-adds it
            if (entry := self._stubs.pop((worker.worker_id, worker.address), None)) is not None:
                await entry[0].close()
        for turn in turns:
            if turn.future.done():
                continue
            turn.attempts += 1
            if turn.attempts >= self.max_attempts:
                reason = error or "the call ended without the turn's completion"
                turn.future.set_exception(GenerationFailed(f"{self.max_attempts} attempts failed, last: {reason}"))
            else:
                turn.affinity = ""
                self._pending.append(turn)
        self._wake.set()
