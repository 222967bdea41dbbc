"""``relayrl up examples/reasoning-gym.yaml`` (2 steps, the tiny chat model): a reasoning-gym task's rows reach the
engine with the library's system prompt and both library rewards score them, in training and on the held-out
set, whose questions the training's rows do not have."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.data import gym_tasks

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/reasoning-gym.yaml"


def test_up_trains_and_evaluates_a_reasoning_gym_task_with_both_rewards(tmp_path) -> None:
    sets = ["trainer.steps=2", f"run.dir={tmp_path}", "eval.every=2"]
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "up", str(EXAMPLE), *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "reasoning-gym"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward_mean" in m]  # the training steps' lines (eval lines beside them)
    assert [s["step"] for s in steps] == [1, 2]
    assert all({"rewards/reasoning_gym", "rewards/math_verify"} <= set(s) for s in steps)
    evals = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert evals and all("Given a problem, your task is" in e["rendered_prompt"] for e in evals)
    files = {len(gym_tasks.questions(f)): gym_tasks.questions(f) for f in (run / "assets").glob("reasoning-gym-*")}
    # the training: 988 distinct questions in its 1000 rows; the held-out set: seed 5000's 100 less 3 the training has
    assert sorted(files) == [97, 988]
    train, heldout = files[max(files)], files[min(files)]
    assert not train & heldout and {e["prompt"] for e in evals} <= heldout


def test_relayrl_eval_scores_the_examples_heldout_set(tmp_path) -> None:
    """``relayrl eval`` checks the sets as written, then generates their rows: a reasoning-gym set was refused as
    "set beside path <its generated file>" (about 20 s: one rollout worker's start, 3 prompts)."""
    from relayrl.config import load_config
    from relayrl.models.assets import prepare_model

    cfg = load_config(EXAMPLE)
    prepare_model(cfg)
    sets = [f"run.dir={tmp_path}", "eval.max_prompts=3", "eval.max_tokens=4"]
    argv = ["eval", str(EXAMPLE), "--checkpoint", cfg.model.path, "--generations"]
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *argv, *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["results"]["heldout"]["prompts"] == 3
    generations = report["generations"]["heldout"]
    assert all("Given a problem, your task is" in g["rendered_prompt"] for g in generations)
    train, heldout = sorted(
        (gym_tasks.questions(f) for f in (tmp_path / "reasoning-gym" / "assets").glob("reasoning-gym-*")), key=len
    )[::-1]
    assert {g["prompt"] for g in generations} <= heldout and not heldout & train
