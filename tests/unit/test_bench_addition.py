"""``relayrl bench addition`` reads the example's run back: the reward gain over its steps, and the held-out set's
greedy accuracy before training (version 0) and after (the last eval), from metrics.jsonl's eval lines."""

from __future__ import annotations

import json

from relayrl.bench.addition import summarize
from relayrl.bench.example_run import read_lines


def test_the_summary_reads_the_reward_gain_and_the_heldout_accuracy_before_and_after(tmp_path) -> None:
    lines = [{"eval": "heldout", "step": 0, "mean@1": 0.1, "pass@1": 0.1, "prompts": 20}]
    for step in range(1, 21):
        lines.append({"step": step, "reward_mean": 0.1 if step <= 10 else 0.6, "time": 100.0 + step,
                      "step_seconds": 1.0, "response_len_mean": 5.0, "logprob_mismatch": 1e-6})  # fmt: skip
        if step % 10 == 0:
            lines.append({"eval": "heldout", "step": step, "mean@1": step / 20, "pass@1": step / 20, "prompts": 20})
    lines.append({"eval": "other", "step": 20, "mean@1": 0.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    records, evals = read_lines(path)
    out = summarize(records, evals, wall_s=30.0)
    assert out["steps"] == 20 and out["train_wall_s"] == 20.0
    assert (round(out["reward_first10"], 6), round(out["reward_last10"], 6), round(out["reward_gain"], 6)) == (
        0.1, 0.6, 0.5,
    )  # fmt: skip
    assert out["heldout_before"] == {"policy_version": 0, "accuracy": 0.1, "prompts": 20}
    assert out["heldout_after"] == {"policy_version": 20, "accuracy": 1.0, "prompts": 20}
    assert [p["policy_version"] for p in out["heldout_curve"]] == [0, 10, 20]
    assert out["per_step"][0]["logprob_mismatch"] == 1e-6


def test_a_reward_with_partial_credit_is_read_as_the_share_at_full_marks() -> None:
    """relayrl bench reasoning-gym reads pass@1: its scorers give "3 + 4 = 7" a third of a mark for "7"."""
    evals = [{"eval": "heldout", "step": v, "mean@1": 0.4 + v / 100, "pass@1": v / 100} for v in (0, 20)]
    records = [{"step": 1, "reward_mean": 0.5, "time": 1.0, "step_seconds": 1.0}]
    out = summarize(records, evals, wall_s=1.0, metric="pass@1")
    assert out["heldout_metric"] == "pass@1"
    assert (out["heldout_before"]["accuracy"], out["heldout_after"]["accuracy"]) == (0.0, 0.2)
