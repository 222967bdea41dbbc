"""One small real run (controller, a worker, a trainer rank) with the training knobs of issue 40 item 7 on: an lr
warmup and cosine schedule, two weighted reward functions, a prompt-length limit that filters long rows, gradient
checkpointing and a checkpoint limit. Each assertion reads what the run left: metrics.jsonl, the ledger, the
checkpoints, the PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from relayrl.config import load_config
from relayrl.data.dataset import render_prompt
from relayrl.data.digits import digits_rows
from relayrl.trainer.metrics import read_metrics
from relayrl.trainer.schedule import lr_at

from .jobs import launch, tail, wait_exit

pytestmark = pytest.mark.slow

STEPS, LONG_EVERY = 4, 3
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> tuple[Path, int]:
    """The run's directory and its prompt limit (every LONG_EVERY-th row of its data is longer)."""
    tmp = tmp_path_factory.mktemp("knobs")
    rows = digits_rows(300, seed=1)
    for i in range(0, len(rows), LONG_EVERY):
        rows[i] = {**rows[i], "prompt": "0 " * 12 + rows[i]["prompt"]}
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limit = max(len(render_prompt(tokenizer, r["prompt"], "auto")) for r in digits_rows(50, seed=2))
    config = {
        "run": {"name": "knobs", "dir": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(data), "max_prompt_tokens": limit},
        "rollout": {"workers": 1, "n": 4, "max_tokens": 4},
        "controller": {
            "prompts_per_gen_batch": 4, "train_batch_groups": 4, "max_gen_batches": 50,
            "reward": {"fns": {"prefix_match": 1.0, "exact_match": 0.5}},
        },
        "trainer": {
            "steps": STEPS, "nproc": 1, "lr": 0.003, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1,
            "checkpoint_every": 1, "save_total_limit": 2, "gradient_checkpointing": True,
        },
        "weight_sync": {"bucket_mib": 1, "timeout_s": 30},
    }  # fmt: skip
    path = tmp / "knobs.yaml"
    path.write_text(json.dumps(config))
    job, cfg = launch(path)
    try:
        assert wait_exit(job, "trainer", 300) == 0, tail(job, "trainer")
    finally:
        job.stop()
    return cfg.run_dir, limit


def test_each_step_trains_at_the_scheduled_lr(run) -> None:
    run_dir, _ = run
    trainer = load_config(run_dir / "config.yaml").trainer
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, trainer) for s in range(1, STEPS + 1)], rel=1e-12)
    assert records[0]["lr"] == 0.003 / 2 and records[1]["lr"] == 0.003  # warmup, then the peak
    state = json.loads((run_dir / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert state["lr"] == pytest.approx(records[-1]["lr"])  # the schedule's state goes with the checkpoint


def test_two_weighted_rewards_are_logged_apart_and_summed(run) -> None:
    run_dir, _ = run
    for r in read_metrics(run_dir / "metrics.jsonl"):
        prefix, exact = r["rewards/prefix_match"], r["rewards/exact_match"]
        assert r["score_mean"] == pytest.approx(1.0 * prefix + 0.5 * exact, abs=1e-9)


def test_prompts_over_the_limit_are_filtered_counted_and_in_the_ledger(run) -> None:
    run_dir, limit = run
    records = read_metrics(run_dir / "metrics.jsonl")
    events = [json.loads(line) for line in (run_dir / "controller" / "ledger.jsonl").read_text().splitlines()]
    events = [e for e in events if "id" in e]
    reasons = {e["id"]: e["reason"] for e in events if e["state"] == "filtered" and e["reason"].startswith("prompt")}
    too_long = set(reasons)
    assert too_long and sum(r["prompts_too_long"] for r in records) >= len(too_long)
    assert all(int(pid.rpartition(":")[2]) % LONG_EVERY == 0 for pid in too_long)  # the long rows, only them
    trained = {e["id"] for e in events if e["state"] == "trained"}
    assert trained and not any(int(pid.rpartition(":")[2]) % LONG_EVERY == 0 for pid in trained)
    assert all(reason.endswith(f" tokens > data.max_prompt_tokens {limit}") for reason in reasons.values())


def test_checkpoints_beyond_the_limit_are_deleted(run) -> None:
    run_dir, _ = run
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS - 1}", f"step_{STEPS}"]


def test_metrics_png_is_written_beside_reward_png(run) -> None:
    run_dir, _ = run
    assert (run_dir / "reward.png").read_bytes().startswith(PNG)
    assert (run_dir / "metrics.png").read_bytes().startswith(PNG)
