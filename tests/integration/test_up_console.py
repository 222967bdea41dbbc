"""What ``relayrl up`` shows without a terminal (its output to a file, as under nohup, Slurm or CI), through one real
run: a line per step (step/total, reward, s/step) and per eval while the run goes, the header's log path and the
run directory each on one line however long, a summary whose reward windows fit a short run and which shows the
held-out result before -> after (summary.json too), and no lock file left beside the run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.runtime.procs import kill_tree
from relayrl.runtime.runlock import RunLock
from relayrl.trainer.metrics import read_evals, read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.timeout(600)
def test_up_without_a_terminal_prints_a_line_per_step_and_the_held_out_result_before_and_after(
    make_config, tmp_path: Path
) -> None:
    runs = tmp_path / f"runs-{'x' * 90}"  # the log path is longer than the 80 columns of a console without a terminal
    config = make_config(
        "console",
        run={"name": "console", "dir": str(runs), "seed": 0},
        trainer={"steps": STEPS},
        eval={"sets": {"heldout": {"path": "builtin:digits-heldout"}}, "every": 2},
    )
    cfg = load_config(config)
    out = tmp_path / "up.out"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"PYTHONPATH": str(ROOT)}
    with out.open("wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "relayrl.cli", "up", str(config)],
            stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        while "step 1/" not in out.read_text():  # the first step's line comes while the run goes on
            assert up.poll() is None, out.read_text()[-3000:]
            time.sleep(0.1)
        assert up.poll() is None
        assert up.wait(timeout=540) == 0, out.read_text()[-3000:]
    finally:
        if up.poll() is None:
            kill_tree(up.pid)
    text = out.read_text()
    lines = text.splitlines()

    assert f"logs in {cfg.run_dir / 'logs'}" in next(line for line in lines if line.startswith("controller "))
    step_line = re.compile(rf"^step (\d+)/{STEPS} · reward \d+\.\d{{3}} · \d+\.\d{{2}} s/step · version \d+$")
    assert [int(m.group(1)) for line in lines if (m := step_line.match(line))] == list(range(1, STEPS + 1))
    evals = {e["step"]: e for e in read_evals(cfg.run_dir / "metrics.jsonl")}
    assert sorted(evals) == [0, 2, 4]
    for version, record in evals.items():
        assert any(
            line.startswith(f"eval heldout at version {version}: mean@1 {record['mean@1']:.3f}") for line in lines
        )
    steps = {r["step"]: r for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
    for version in (0, 2):  # K = 0 on shared cores: step v + 1 trains once the eval of v is done (evals_first)
        began = steps[version + 1]["time"] - steps[version + 1]["train_seconds"] - steps[version + 1]["sync_seconds"]
        assert evals[version]["time"] <= began, (version, evals[version], steps[version + 1])

    assert "reward, first 2 steps" in text and "reward, last 2 steps" in text and "10 steps" not in text
    before, after = evals[0]["mean@1"], evals[STEPS]["mean@1"]
    assert f"held-out: heldout mean@1 │ {before:.3f} → {after:.3f} (v0 → v{STEPS})" in " ".join(text.split())
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert summary["heldout"]["heldout"] == {
        "metric": "mean@1", "before": before, "before_version": 0, "after": after, "after_version": STEPS,
    }  # fmt: skip
    assert summary["reward_window"] == 2
    assert f"run directory: {cfg.run_dir}" in lines

    assert not RunLock.path_for(cfg.run_dir).exists() and not list(runs.glob(".*"))  # no lock file left behind
