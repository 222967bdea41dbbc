"""``relayrl bench addition`` reads the example's run back: the reward gain over its steps, and the held-out set's
greedy accuracy before training (version 0) and after (the last eval), from metrics.jsonl's eval lines."""

from __future__ import annotations

import json

from relayrl.bench.addition import summarize
from relayrl.bench.example_run import read_lines


def test_the_summary_reads_the_reward_gain_and_the_heldout_accuracy_before_and_after(tmp_path) -> None:
    lines = [{"eval": "heldout", "step": 0, "mean@1": 0.1, "pass@1": 0.1}]
    for step in range(1, 21):
        lines.append({"step": step, "reward_mean": 0.1 if step <= 10 else 0.6, "time": 100.0 + step,
                      "step_seconds": 1.0, "response_len_mean": 5.0, "logprob_mismatch": 1e-6})  # fmt: skip
        if step % 10 == 0:
            lines.append({"eval": "heldout", "step": step, "mean@1": step / 20, "pass@1": step / 20})
    lines.append({"eval": "other", "step": 20, "mean@1": 0.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    records, evals = read_lines(path)
    out = summarize(records, evals, wall_s=30.0)
    assert out["steps"] == 20 and out["train_wall_s"] == 20.0
    assert (round(out["reward_first10"], 6), round(out["reward_last10"], 6), round(out["reward_gain"], 6)) == (
        0.1, 0.6, 0.5,
    )  # fmt: skip
    assert out["heldout_before"] == {"policy_version": 0, "accuracy": 0.1}
    assert out["heldout_after"] == {"policy_version": 20, "accuracy": 1.0}
    assert [p["policy_version"] for p in out["heldout_curve"]] == [0, 10, 20]
    assert out["per_step"][0]["logprob_mismatch"] == 1e-6
