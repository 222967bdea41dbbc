"""``relayrl bench scorer``'s parts: the conversations and requests it sends, the served and in-process ways scoring
the same requests alike (a tiny reward model, served in this process over real gRPC), and the RL step figures read
from a run's metrics."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.scorer import (
    BATCH_KEY,
    LATENCY_KEY,
    PAIRS,
    SCORER,
    conversations,
    in_process,
    load_in_process,
    ratios,
    requests_of,
    served,
    step_figures,
)
from relayrl.config import RelayConfig
from relayrl.services.scorer_server import serve_scorer
from tests.unit.scorer_testing import write_tiny_reward_model


def test_conversations_are_each_preference_rows_prompt_with_either_response_cycled() -> None:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    items = conversations(PAIRS, 2 * len(rows) + 1)
    assert items[0] == rows[0]["prompt"] + rows[0]["chosen"]
    assert items[1] == rows[0]["prompt"] + rows[0]["rejected"]
    assert items[-1] == items[0] and all(c[-1]["role"] == "assistant" for c in items)
    assert [len(r) for r in requests_of(items[:19], 8)] == [8, 8, 3]


def test_served_scores_are_the_in_process_scores_of_the_same_requests(tmp_path) -> None:
    rm = write_tiny_reward_model(tmp_path / "rm", seed=1)
    scorers = {SCORER: {"model": str(rm), "precision": "float32", "max_batch_size": 4, "servers": ["127.0.0.1:1"]}}
    cfg = RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, "scorers": scorers})
    requests = requests_of(conversations(PAIRS, 12), 2)

    local, reference = in_process(load_in_process(cfg.scorers[SCORER], threads=1), requests)
    server, worker = serve_scorer(cfg, SCORER, host="127.0.0.1", port=0)
    try:
        figures, scores = served(cfg.scorers[SCORER], [f"127.0.0.1:{server.port}"], requests, callers=3)
    finally:
        server.stop(grace_s=0)
        worker.stop()
    assert scores == pytest.approx(reference, abs=1e-5) and len(scores) == 12
    assert len(set(scores)) > 1
    # the timed requests' items over the model calls they took: at least one item a call, at most a full batch
    assert 1.0 <= figures["mean_batch_size"] <= 4.0
    assert (figures["workers"], figures["callers"], local["threads"]) == (1, 3, 1)
    row = {"in_process": {"pairs_per_s": 2.0}, "served_1": {"pairs_per_s": 6.0}, "served_2": {"pairs_per_s": 9.0}}
    assert ratios(row) == {"served_1_vs_in_process": 3.0, "served_2_vs_served_1": 1.5}


def test_step_figures_take_medians_over_every_runs_steps_after_the_first() -> None:
    first = [
        {"step": 1, "step_seconds": 90.0, "generation_seconds": 50.0, LATENCY_KEY: 3.0, BATCH_KEY: 1.0},
        {"step": 2, "step_seconds": 60.0, "generation_seconds": 30.0, LATENCY_KEY: 1.0, BATCH_KEY: 4.0},
        {"step": 3, "step_seconds": 500.0, "generation_seconds": 34.0, LATENCY_KEY: 2.0, BATCH_KEY: 8.0},
    ]
    second = [{**first[0], "step_seconds": 80.0}, {**first[1], "step_seconds": 64.0, LATENCY_KEY: 1.5}]
    out = step_figures([first, second], walls=[300.0, 200.0])
    assert out["runs"] == [
        {"wall_s": 300.0, "step_seconds": [90.0, 60.0, 500.0]},
        {"wall_s": 200.0, "step_seconds": [80.0, 64.0]},
    ]
    # steps 2 and 3 of the first run and step 2 of the second: one slow step does not move the median
    assert (out["steps_measured"], out["step_seconds_median"], out["generation_seconds_median"]) == (3, 64.0, 30.0)
    assert (out["scorer_latency_s_median"], out["scorer_batch_size_median"]) == (1.5, 4.0)
    without = step_figures([[{k: v for k, v in r.items() if "scorer/" not in k} for r in first]], walls=[1.0])
    assert "scorer_latency_s_median" not in without and "scorer_batch_size_median" not in without
