"""Features that landed apart, met as a user meets them (issue 44, items 4 and 5): `relayrl up examples/digits.yaml
--set algorithm.advantage=gae` (PPO with a critic, beside the example's samples log and held-out eval) trains and
logs its samples with the advantages its steps trained with, where the trainer died at step 1 (the samples log
recomputed advantages through the registry, which refuses gae). `relayrl check` refusing the impossible
combinations as `relayrl up` does: tests/unit/test_cli_refusals.py; every combination in one process:
tests/unit/test_combinations.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from relayrl.trainer.metrics import read_evals, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_ppo_with_a_critic_trains_beside_the_samples_log_and_eval(tmp_path: Path) -> None:
    sets = ["algorithm.advantage=gae", "trainer.steps=2", "samples.every=1", f"run.dir={tmp_path / 'runs'}"]
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(ROOT / "examples" / "digits.yaml")]
    done = subprocess.run(
        [*argv, *(arg for s in sets for arg in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "digits"
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log")) if run_dir.exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs
    assert "restart" not in done.stderr  # no role died on the way
    steps = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2] and all(r["value_loss"] > 0 for r in steps)  # the critic trained
    assert sorted(r["policy_version"] for r in read_evals(run_dir / "metrics.jsonl")) == [0, 2]
    logged = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in logged}) == [1, 2] and all(len(r["samples"]) == 16 for r in logged)
    advantages = [s["advantage"] for r in logged for s in r["samples"]]
    assert all(math.isfinite(a) for a in advantages) and len(set(advantages)) > 1, advantages
