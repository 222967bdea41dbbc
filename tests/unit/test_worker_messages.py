"""What a Generate stream's messages hold: each finished row as it finishes, or (``whole_groups``, the controller's
dispatch) each prompt's group in one message once complete, with an abort sent at once and nothing dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_testing import sharp_tiny_model

from relayrl.rollout.engine import EngineCompletion
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker, whole_groups
from relayrl.v1 import common_pb2, rollout_pb2
from relayrl.wire.sampling import GenerationLimits


def row(prompt: int, sample: int, finish: str = "stop") -> EngineCompletion:
    return EngineCompletion(prompt, sample, [7], [-0.5], finish)


def test_rows_are_held_until_their_group_is_complete() -> None:
    batches = [[row(0, 0), row(1, 0)], [row(1, 1)], [row(0, 1), row(2, 0), row(2, 1)]]
    out = [[(c.prompt_index, c.sample_index) for c in batch] for batch in whole_groups(iter(batches), n=2)]
    assert out == [[(1, 0), (1, 1)], [(0, 0), (0, 1), (2, 0), (2, 1)]]


def test_an_abort_sends_everything_held_at_once() -> None:
    batches = [[row(0, 0)], [row(1, 0), row(0, 1, "abort")], [row(1, 1, "abort")]]
    out = [[(c.prompt_index, c.sample_index, c.finish_reason) for c in batch] for batch in whole_groups(batches, 2)]
    assert out == [[(0, 0, "stop"), (0, 1, "abort"), (1, 0, "stop")], [(1, 1, "abort")]]


def test_a_short_group_is_sent_when_the_engine_ends_and_the_source_is_closed() -> None:
    closed = []

    def source():
        try:
            yield [row(0, 0)]
        finally:
            closed.append(True)

    assert [[c.sample_index for c in b] for b in whole_groups(source(), n=3)] == [[0]]
    stream = whole_groups(source(), n=1)
    next(stream)
    stream.close()  # a caller that stops listening
    assert closed == [True, True]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> RolloutWorker:
    engine = HFEngine(str(sharp_tiny_model(Path(tmp_path_factory.mktemp("tiny")))), max_batch_size=16)
    return RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())


@pytest.mark.parametrize("grouped", [False, True])
def test_generate_sends_whole_groups_when_asked(worker: RolloutWorker, grouped: bool) -> None:
    n = 4
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id=f"p{i}", token_ids=ids) for i, ids in enumerate([[3, 4], [5], [6]])],
        params=common_pb2.SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=12, seed=5),
        whole_groups=grouped,
    )
    messages = [[(c.prompt_id, c.sample_index) for c in m.completions] for m in worker.generate(request, lambda: True)]
    rows = sorted(r for m in messages for r in m)
    assert rows == sorted((f"p{i}", s) for i in range(3) for s in range(n))  # every row exactly once
    groups_split = any(
        0 < sum(p == pid for p, _ in m) < n for m in messages for pid in {p for p, _ in m}
    )  # some message holds part of a group
    assert groups_split is not grouped
    if grouped:
        assert len(messages) <= 3
