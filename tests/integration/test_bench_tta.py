"""The TRL side of ``relayrl bench tta`` on the demo's tiny model: TRL's ``GRPOTrainer`` saves a checkpoint, ``relayrl
eval`` scores it while TRL waits, the score lands in the metrics file as relayrl's eval line, the checkpoint is
deleted and training stops at the target; the wait is the run's pause, not its training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.bench.e2e import DEMO_CONFIG, trl_spec
from relayrl.config import load_config
from relayrl.models.assets import prepare_assets
from relayrl.trainer.metrics import read_evals, read_metrics

pytestmark = pytest.mark.slow  # trl is in the dev extra: missing, this fails, never skips


@pytest.mark.timeout(900)
def test_trl_checkpoints_are_scored_by_relayrl_eval_and_training_stops_at_the_target(tmp_path: Path) -> None:
    sets = [f"run.dir={tmp_path / 'assets'}", "rollout.n=2", "controller.prompts_per_gen_batch=2",
            "controller.train_batch_groups=2", "trainer.mini_batches=1", "eval.max_prompts=4"]  # fmt: skip
    cfg = load_config(DEMO_CONFIG, sets)
    prepare_assets(cfg)
    sets += [f"model.path={cfg.model.path}", f"data.path={cfg.data.path}"]
    spec = trl_spec(cfg, 3, 1, tmp_path)
    score = [sys.executable, "-m", "relayrl.cli", "eval", str(DEMO_CONFIG), *(a for s in sets for a in ("--set", s))]
    # the first round's score (whatever it is) reaches 0.0: one checkpoint, then TRL stops before round 2
    spec["score"] = {"every": 1, "target": 0.0, "metric": "mean@1", "set": "heldout", "argv": score}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "relayrl.bench.trl_runner", str(tmp_path / "spec.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = tmp_path / "metrics.jsonl"
    (scored,) = read_evals(metrics)
    assert scored["eval"] == "heldout" and scored["step"] == 1 and 0.0 <= scored["mean@1"] <= 1.0
    assert scored["eval_seconds"] > 0
    assert [r["step"] for r in read_metrics(metrics)] == [1]  # stopped at the target: 1 of 3 rounds
    report = json.loads((tmp_path / "trl-output" / "eval-1.json").read_text())
    assert report["policy_version"] == 1 and report["results"]["heldout"]["prompts"] == 4
    assert not (tmp_path / "trl-output" / "checkpoint-1").exists()  # scored, then deleted
