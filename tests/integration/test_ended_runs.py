"""How a run ended is said after it (issue 45, item 4), through `relayrl up` and `relayrl status --run` as a user
meets them: a reward function that returns a string fails the run (exit 1), and status names the failure and its
reason; Ctrl-C stops one (exit 130), and status says so, with the last step's rollout-correction diagnostics; each
leaves its summary.json, as a finished run does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.trainer.metrics import read_metrics

from .jobs import finish, start_up, wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def status(run_dir: Path) -> tuple[str, dict]:
    """`relayrl status --run RUN_DIR`: its line, and its --json record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RELAYRL_CONTROLLER": "", "COLUMNS": "1000"}
    outputs = []
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", "status", "--run", str(run_dir), *extra],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout.strip())
    return outputs[0], json.loads(outputs[1])


def test_a_run_failed_by_its_reward_function_says_so_and_why(tmp_path, make_config) -> None:
    (tmp_path / "verdicts.py").write_text('def verdict(response, answer):\n    return "right"\n')
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    path = make_config("broken", rollout={"workers": 1}, controller={"reward": {"fn": "verdicts:verdict"}})
    code, err = finish(start_up(path, env=env))
    assert code == 1, err
    run_dir = load_config(path).run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "failed" and "verdicts:verdict" in summary["reason"], summary
    assert "'right'" in summary["reason"] and summary["steps"] == 0
    line, record = status(run_dir)
    assert line.startswith(f"run {run_dir}: failed at ") and summary["reason"] in line, line
    assert "not finished" not in line and "--resume` continues it" not in line
    assert record["state"] == "failed" and record["reason"] == summary["reason"]


def test_a_run_stopped_by_ctrl_c_says_so_and_how_it_goes_on(tmp_path, make_config) -> None:
    path = make_config("stopped", rollout={"workers": 1}, trainer={"steps": 200})
    run_dir = load_config(path).run_dir
    up = start_up(path)
    try:
        wait_until(lambda: read_metrics(run_dir / "metrics.jsonl") or up.poll() is not None, 300, "the first step")
        os.killpg(up.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    finally:
        code, err = finish(up)
    assert code == 130, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "stopped" and summary["reason"].startswith("SIGINT: stopped by the operator")
    assert summary["steps"] == len(read_metrics(run_dir / "metrics.jsonl")) >= 1
    line, record = status(run_dir)
    assert line.startswith(f"run {run_dir}: stopped at ") and "`relayrl up --resume` continues it" in line, line
    assert record["state"] == "stopped"
    last = read_metrics(run_dir / "metrics.jsonl")[-1]  # its rollout-correction diagnostics, said after it too
    assert record["step_metrics"] == {k: v for k, v in last.items() if k.startswith("rollout_corr/")}
    assert {"kl_k1", "kl_k3", "chi2_token", "log_ppl_diff", "ess", "rejected_token_share", "is_weight_max"} <= {
        k.removeprefix("rollout_corr/") for k in record["step_metrics"]
    }
    assert f"\nrollout correction at step {last['step']} (rollout_corr/*): chi2_seq " in line, line
