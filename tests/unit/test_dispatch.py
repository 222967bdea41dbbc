"""Dispatch over real gRPC workers (in-process servers): a straggler's chunk is also sent to an idle worker, the
first complete group wins and the straggling call is cancelled; a seeded run's calls each carry their own seed."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from relayrl.client.workers import WorkerRegistry
from relayrl.controller.dispatch import Dispatcher, PromptJob, call_seed
from relayrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from relayrl.wire.sampling import SamplingParams

SLOW_S = 60.0  # the straggler answers only after this (or never: it is cancelled)


class _Worker(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers each prompt with ``n`` one-token completions stamped with its id, after ``delay_s``."""

    def __init__(self, worker_id: str, delay_s: float) -> None:
        self.worker_id, self.delay_s = worker_id, delay_s
        self.cancelled = False
        self.calls: list[tuple[list[str], int | None]] = []  # (prompt ids, seed) of each call

    def Generate(self, request, context):
        seed = request.params.seed if request.params.HasField("seed") else None
        self.calls.append(([p.prompt_id for p in request.prompts], seed))
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline:
            if not context.is_active():
                self.cancelled = True
                return
            time.sleep(0.01)
        yield rollout_pb2.GenerateResponse(
            completions=[
                common_pb2.Completion(
                    prompt_id=p.prompt_id, sample_index=i, token_ids=[7], logprobs=[-0.5], worker_id=self.worker_id
                )
                for p in request.prompts
                for i in range(request.params.n)
            ]
        )


@pytest.fixture
def fleet():
    """Two registered workers, each its own gRPC server: 'slow' (registered first) and 'fast'."""
    registry = WorkerRegistry(timeout_s=300)
    servers, workers = [], {}
    for worker_id, delay in (("slow", SLOW_S), ("fast", 0.0)):
        workers[worker_id] = _Worker(worker_id, delay)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(workers[worker_id], server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        registry.register(worker_id, f"127.0.0.1:{port}", "hf", 0)
    yield registry, workers
    for server in servers:
        server.stop(0)


def test_a_straggling_chunk_is_copied_to_an_idle_worker_and_the_first_group_wins(fleet) -> None:
    registry, workers = fleet
    dispatcher = Dispatcher(registry, chunk_size=1, generate_timeout_s=300, straggler_factor=3.0)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=1)
    warmup = dispatcher.run([PromptJob(f"w{i}", [4, 5]) for i in range(3)], params, only=frozenset({"fast"}))
    assert sorted(warmup.groups) == ["w0", "w1", "w2"] and len(dispatcher.chunk_seconds) == 3  # the median's base

    started = time.monotonic()
    result = dispatcher.run([PromptJob("p0", [4, 5])], params)  # goes to 'slow': never called, so first in line
    assert time.monotonic() - started < SLOW_S / 2  # the copy answered, not the straggler
    assert result.failed == {}
    assert [c.worker_id for c in result.groups["p0"]] == ["fast", "fast"]  # one whole group, from the copy
    deadline = time.monotonic() + 30
    while not workers["slow"].cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers["slow"].cancelled  # the straggling call was cancelled once the copy delivered
    assert registry.get("slow").in_flight == registry.get("fast").in_flight == 0


def test_each_call_of_a_seeded_run_has_a_seed_of_its_prompts_and_an_unseeded_run_none(fleet) -> None:
    registry, workers = fleet
    dispatcher = Dispatcher(registry, chunk_size=2, generate_timeout_s=300)
    jobs = [PromptJob(f"0:{row}", [4, 5]) for row in range(4)]
    seeded = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=1, seed=7)
    for _ in range(2):
        assert not dispatcher.run(jobs, seeded, only=frozenset({"fast"})).failed
    calls = sorted(workers["fast"].calls)
    assert calls[0] == calls[1] and calls[2] == calls[3]  # the same calls draw alike run after run
    assert [ids for ids, _ in calls[::2]] == [["0:0", "0:1"], ["0:2", "0:3"]]
    assert [seed for _, seed in calls[::2]] == [call_seed(7, ["0:0", "0:1"]), call_seed(7, ["0:2", "0:3"])]
    assert len({seed for _, seed in calls}) == 2 and all(0 <= seed < 2**31 for _, seed in calls)
    assert call_seed(8, ["0:0", "0:1"]) != call_seed(7, ["0:0", "0:1"])  # another run seed, other draws
    workers["fast"].calls.clear()
    assert not dispatcher.run(jobs, SamplingParams(n=2, max_tokens=1), only=frozenset({"fast"})).failed
    assert [seed for _, seed in workers["fast"].calls] == [None, None]
