"""``relayrl eval`` of a model on HumanEval (``data.path: humaneval``, ``controller.reward.fn: code_tests``): the
library's first problems reach the engine as the library's prompts, and each greedy completion's reward is the
verdict of its check program in the sandbox; the report has pass@1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.rewards.code import CodeTests, completion_of
from relayrl.runtime.humaneval import problems

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = 3


def test_relayrl_eval_scores_humaneval_completions_by_running_their_tests(tmp_path, tiny_model_dir) -> None:
    config = {
        "run": {"name": "humaneval", "dir": str(tmp_path / "runs")},
        "model": {"path": str(tiny_model_dir)},  # no chat template: the stub is the prompt, continued
        "data": {"path": "humaneval"},
        "rollout": {"workers": 1, "max_tokens": 8},
        "controller": {"reward": {"fn": "code_tests"}},
        "trainer": {"nproc": 1},
        "eval": {"sets": {"humaneval": {"path": "humaneval"}}, "max_prompts": PROBLEMS},
    }
    path = tmp_path / "humaneval.yaml"
    path.write_text(json.dumps(config))
    argv = ["eval", str(path), "--checkpoint", str(tiny_model_dir), "--generations"]
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    generations = report["generations"]["humaneval"]
    library = problems()[:PROBLEMS]
    assert [g["prompt"] for g in generations] == [p["prompt"] for p in library]
    checker = CodeTests()
    rewards = []
    for group, problem in zip(generations, library, strict=True):
        (sample,) = group["samples"]
        rewards.append(sample["reward"])
        assert sample["reward"] == float(checker.check(problem, completion_of(sample["response"])).passed)
    assert report["results"]["humaneval"]["pass@1"] == sum(rewards) / PROBLEMS
