"""Episode turns on rollout workers (TurnDispatcher) over real gRPC: turns waiting together share a Generate call,
a turn stays on its episode's worker, an aborted row is sent again, and a turn fails after its attempts."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from relayrl.client.workers import WorkerRegistry
from relayrl.episodes.loop import GenerationFailed
from relayrl.episodes.turns import TurnDispatcher
from relayrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from relayrl.wire.sampling import SamplingParams


class EchoWorker(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers each row with one token: its prompt's length; ``abort_first`` rows come back "abort" once."""

    def __init__(self, name: str, abort_first: int = 0, always_abort: bool = False) -> None:
        self.name, self.abort_first, self.always_abort = name, abort_first, always_abort
        self.calls: list[int] = []  # rows per call

    async def Generate(self, request, context):
        self.calls.append(len(request.prompts))
        await asyncio.sleep(0.01)
        completions = []
        for p in request.prompts:
            abort = self.always_abort or self.abort_first > 0
            self.abort_first -= 1
            completions.append(
                common_pb2.Completion(
                    prompt_id=p.prompt_id,
                    token_ids=[len(p.token_ids)],
                    logprobs=[-1.0],
                    worker_id=self.name,
                    finish_reason=common_pb2.FINISH_REASON_ABORT if abort else common_pb2.FINISH_REASON_STOP,
                )
            )
        yield rollout_pb2.GenerateResponse(completions=completions)


async def serve(workers: dict[str, EchoWorker], registry: WorkerRegistry) -> list[grpc.aio.Server]:
    servers = []
    for name, servicer in workers.items():
        server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        registry.register(name, f"127.0.0.1:{port}", "hf", 0)
        servers.append(server)
    return servers


def run(workers: dict[str, EchoWorker], body) -> None:
    async def main():
        registry = WorkerRegistry(30.0, max_in_flight=4)
        servers = await serve(workers, registry)
        turns = TurnDispatcher(registry, SamplingParams(n=8), generate_timeout_s=10, max_rows_per_call=64)
        try:
            await body(turns)
        finally:
            await turns.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(main())


def test_waiting_turns_share_a_call_and_stay_on_their_worker():
    a, b = EchoWorker("a"), EchoWorker("b")

    async def body(turns):
        first = await asyncio.gather(*(turns.generate([1] * (i + 1), 4) for i in range(10)))
        assert [list(c.token_ids) for c in first] == [[i + 1] for i in range(10)]
        assert sum(a.calls) + sum(b.calls) == 10 and len(a.calls) + len(b.calls) < 10  # rows shared calls
        again = await asyncio.gather(*(turns.generate([1, 2], 4, c.worker_id) for c in first))
        assert [c.worker_id for c in again] == [c.worker_id for c in first]  # affinity held

    run({"a": a, "b": b}, body)


def test_an_aborted_row_is_generated_again():
    worker = EchoWorker("a", abort_first=1)

    async def body(turns):
        completion = await turns.generate([1, 2, 3], 4)
        assert list(completion.token_ids) == [3] and turns.aborted == 1 and worker.calls == [1, 1]

    run({"a": worker}, body)


def test_a_turn_fails_after_its_attempts():
    async def body(turns):
        with pytest.raises(GenerationFailed, match="3 attempts failed, last: aborted by the worker"):
            await turns.generate([1], 4)

    run({"a": EchoWorker("a", always_abort=True)}, body)
