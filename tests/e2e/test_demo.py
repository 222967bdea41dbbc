"""`relayrl up examples/digits.yaml` as a user runs it (in a temp run dir): the reward rises as promised."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from integration.jobs import gpu_host, up_to_the_end
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_demo_reward_rises(tmp_path):
    overrides = [
        f"run.dir={tmp_path / 'runs'}",
    ]
    run_dir = tmp_path / "runs" / "digits"
    done = up_to_the_end(ROOT / "examples/digits.yaml", overrides, cwd=tmp_path, run_dir=run_dir, timeout=600)

    records = read_metrics(run_dir / "metrics.jsonl")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert len(records) == config["trainer"]["steps"]
    first = sum(r["reward_mean"] for r in records[:10]) / 10
    last = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert first <= 0.3, first
    assert last >= 0.6, last
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert "reward, last 10 steps" in done.stderr  # the summary table
    status = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "status", "--run", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # its controller is gone: the run's summary says how it ended, and when
    assert status.returncode == 0 and "finished at" in status.stdout, status.stderr
    # step 1 waited for the trainer's starting weights: their load aborted no call, so nothing was sent twice
    assert "re-dispatching" not in (run_dir / "logs" / "controller.log").read_text()
    if not gpu_host():  # a CPU host forks every role from its server
        assert not [p.name for p in (run_dir / "logs").glob("*.log") if "not forked" in p.read_text()]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert model.config.vocab_size == len(tokenizer)
    every, steps = config["trainer"]["checkpoint_every"], config["trainer"]["steps"]
    want = {f"step_{s}" for s in range(every, steps + 1, every)} | {f"step_{steps}"}
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == want
