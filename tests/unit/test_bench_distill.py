"""``relayrl bench distill`` reads the student's run back: the reverse KL of its first and last 10 steps (the
trainer's metric), the reward gain, and the held-out greedy accuracy before training and after."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.distill import KL_KEY, summarize_student, teacher_record
from relayrl.bench.example_run import read_lines


def test_the_student_summary_reads_the_reverse_kl_windows_and_the_heldout_accuracy(tmp_path) -> None:
    lines = [{"eval": "heldout", "step": 0, "mean@1": 0.0, "pass@1": 0.0}]
    for step in range(1, 31):
        lines.append({"step": step, "reward_mean": 0.2 if step <= 10 else 0.9, KL_KEY: 3.0 if step <= 10 else 0.5})
    lines.append({"eval": "heldout", "step": 30, "mean@1": 0.9, "pass@1": 0.9})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    out = summarize_student(*read_lines(path), wall_s=12.0)
    assert out["steps"] == 30 and out["wall_s"] == 12.0
    assert (out["reverse_kl_first10"], out["reverse_kl_last10"]) == (3.0, 0.5)
    assert out["reward_gain"] == pytest.approx(0.7)
    assert out["heldout_before"] == {"policy_version": 0, "accuracy": 0.0}
    assert out["heldout_after"] == {"policy_version": 30, "accuracy": 0.9}
    assert out["per_step"][-1] == {"step": 30, "reward_mean": 0.9, KL_KEY: 0.5}


def test_the_teacher_record_reads_the_heldout_accuracy_of_the_run_that_wrote_the_export(tmp_path) -> None:
    evals = [{"eval": "heldout", "step": 0, "mean@1": 0.0}, {"eval": "heldout", "step": 200, "mean@1": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    record = teacher_record(tmp_path / "final", wall_s=None)
    assert record["heldout_after"] == {"policy_version": 200, "accuracy": 1.0}
    assert teacher_record(tmp_path / "elsewhere" / "final", wall_s=3.0)["heldout_after"] is None
