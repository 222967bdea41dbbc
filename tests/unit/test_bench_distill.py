"""``relayrl bench distill`` reads the student's run back: the reverse KL of its first and last steps (the trainer's
metric), the reward gain, and the held-out greedy accuracy before training and after; the SmolLM2 example's student
is scored on the teacher's held-out sums the way the teacher was, and serves the export its teacher command writes."""

from __future__ import annotations

import json
import shlex

import pytest

from relayrl.bench.distill import EXAMPLES, KL_KEY, TEACHER_SFT_SET, Teacher, summarize_student, teacher_record
from relayrl.bench.example_run import ROOT, read_lines
from relayrl.config import load_config, load_offline_config


def student_metrics(tmp_path, steps: int):
    lines = [{"eval": "heldout", "step": 0, "mean@1": 0.0, "pass@1": 0.0}]
    for step in range(1, steps + 1):
        early = step <= steps // 3
        lines.append({"step": step, "reward_mean": 0.2 if early else 0.9, KL_KEY: 3.0 if early else 0.5})
    lines.append({"eval": "heldout", "step": steps, "mean@1": 0.9, "pass@1": 0.9})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return read_lines(path)


def test_the_student_summary_reads_the_reverse_kl_windows_and_the_heldout_accuracy(tmp_path) -> None:
    out = summarize_student(*student_metrics(tmp_path, 30), wall_s=12.0)
    assert out["steps"] == 30 and out["wall_s"] == 12.0 and out["window"] == 10
    assert (out["reverse_kl_first10"], out["reverse_kl_last10"]) == (3.0, 0.5)
    assert out["reward_gain"] == pytest.approx(0.7)
    assert out["heldout_before"] == {"policy_version": 0, "accuracy": 0.0}
    assert out["heldout_after"] == {"policy_version": 30, "accuracy": 0.9}
    assert out["per_step"][-1] == {"step": 30, "reward_mean": 0.9, KL_KEY: 0.5}


def test_a_short_run_averages_half_its_steps_at_each_end_and_says_so(tmp_path) -> None:
    out = summarize_student(*student_metrics(tmp_path, 6), wall_s=1.0)
    assert out["window"] == 3
    assert (out["reverse_kl_first3"], out["reverse_kl_last3"]) == (pytest.approx((3.0 + 3.0 + 0.5) / 3), 0.5)
    assert (out["reward_first3"], out["reward_last3"]) == (pytest.approx((0.2 + 0.2 + 0.9) / 3), 0.9)


def test_the_teacher_record_reads_the_heldout_accuracy_of_the_run_that_wrote_the_export(tmp_path) -> None:
    evals = [{"eval": "heldout", "step": 0, "mean@1": 0.0}, {"eval": "heldout", "step": 200, "mean@1": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    record = teacher_record(Teacher(tmp_path / "final", None, {}), "relayrl up x.yaml")
    assert record["heldout_after"] == {"policy_version": 200, "accuracy": 1.0}
    assert record["trained_by"] == "relayrl up x.yaml"
    elsewhere = Teacher(tmp_path / "elsewhere" / "final", 3.0, {})
    assert teacher_record(elsewhere, "")["heldout_after"] is None


def test_the_smollm2_student_starts_from_the_teachers_base_and_is_scored_as_the_teacher_was() -> None:
    example = EXAMPLES["smollm2"]
    words = shlex.split(example.teacher_command)
    assert words[:3] == ["relayrl", "train", "sft"] and words[4::2] == ["--set"] * len(TEACHER_SFT_SET)
    teacher = load_offline_config("sft", ROOT / words[3], list(TEACHER_SFT_SET))
    student = load_config(example.student_config)
    teacher_eval = load_config(teacher.eval.config)  # the config whose held-out set and sampling scored the teacher

    assert student.scorers["teacher"].kind == "teacher"
    assert student.scorers["teacher"].model == str(teacher.run_dir / "final")
    assert (student.algorithm.advantage, student.algorithm.teacher) == ("distill", "teacher")
    assert student.model.path == teacher.model.path == "builtin:smollm2-135m-instruct"
    assert student.eval.sets == teacher_eval.eval.sets
    assert (student.eval.temperature, student.eval.n) == (teacher_eval.eval.temperature, teacher_eval.eval.n)
    assert student.rollout.max_tokens == teacher_eval.rollout.max_tokens
    assert student.controller.reward.fn == teacher_eval.controller.reward.fn == "last_number"
