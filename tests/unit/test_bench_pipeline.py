"""``relayrl bench pipeline``'s SFT data (relayrl/bench/pipeline.py): the worked solutions the example trains on are
the program's, one per training sum, each scored full marks by the RL stage's reward; a failed stage's runs are
kept."""

from __future__ import annotations

import json
import tempfile

import pytest

from relayrl.bench import pipeline
from relayrl.bench.example_run import scratch
from relayrl.bench.pipeline import ROOT, WORKED, worked_solutions
from relayrl.config import load_config, load_offline_config
from relayrl.rewards.builtin import last_number

TRAIN = ROOT / "examples" / "addition-train.jsonl"


def test_the_committed_worked_solutions_are_the_programs_and_each_earns_the_rl_reward() -> None:
    rows = worked_solutions(TRAIN)
    assert [json.loads(line) for line in WORKED.read_text().splitlines()] == rows
    answers = [json.loads(line)["answer"] for line in TRAIN.read_text().splitlines()]
    assert len(rows) == len(answers) == 80
    for row, answer in zip(rows, answers):
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert last_number(assistant["content"], answer) == 1.0, (row, answer)


def test_the_sft_stage_scores_with_the_rl_stages_eval_and_the_rl_stage_starts_from_its_export() -> None:
    sft = load_offline_config("sft", ROOT / "examples" / "pipeline-sft-grpo" / "sft.yaml")
    rl = load_config(sft.eval.config)
    assert rl.eval is not None and rl.controller.reward.fn == "last_number"
    assert rl.model.path == str(sft.run_dir / "final") and rl.data.path == str(TRAIN.relative_to(ROOT))


def test_a_failed_stage_keeps_the_benchs_runs_and_says_where(monkeypatch, tmp_path, capsys) -> None:
    """A bench whose stage fails leaves its scratch directory (the runs' logs and metrics) and prints its path; a
    bench that ends normally removes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def failing(stage, config, overrides, workdir, timeout_s):
        (workdir / "pipeline-sft").mkdir()
        raise SystemExit("relayrl train sft failed (exit 1)")

    monkeypatch.setattr(pipeline, "train_stage", failing)
    with pytest.raises(SystemExit, match="train sft failed"):
        pipeline.main([])
    (kept,) = tmp_path.iterdir()
    assert (kept / "pipeline-sft").is_dir() and f"kept {kept}" in capsys.readouterr().err
    with scratch("ok-") as workdir:
        assert workdir.parent == tmp_path
    assert not workdir.exists()
