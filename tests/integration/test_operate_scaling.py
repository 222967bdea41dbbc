"""``relayrl scale rollout`` on a real ``relayrl up`` job (controller, workers and trainer as processes).

One worker at the start; past step 2 the operator pauses (so the short run cannot end while a worker
starts) and scales to 2: the launcher starts ``rollout-1``, which registers at version 0; the trainer
pushes it the current weights before it gets any work ("joiners"); after resume it serves, never with
version 0. Back to 1 under load: the launcher drains and stops it. Along the way: a forced weight sync
and a pause that really stops training. At the end every drawn prompt is trained, filtered or failed
with a reason: none pending.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.client import RelayClient, SamplingParams
from relayrl.config import load_config
from relayrl.trainer.metrics import read_metrics

from .jobs import assert_roles_forked, supervised_roles

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# the scale-up, resume, scale-down and pause below take ~30-40 steps here (load 5 on 2 cores); the rest is margin (a
# run that ended first could not be scaled down under load) and a tail the test waits out
STEPS = 70


def relay(*args: str) -> dict:
    """An operator command with --json; returns its parsed output."""
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args, "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def final_ledger(path: Path) -> dict[str, tuple[str, str]]:
    states = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        states[event["id"]] = (event["state"], event.get("reason", ""))
    return states


def test_scale_rollout_up_and_down_on_a_live_run(make_config, monkeypatch):
    config = make_config(
        "scale",
        rollout={"workers": 1, "n": 4, "max_tokens": 4},
        controller={"dynamic_sampling": False},
        trainer={"steps": STEPS, "nproc": 1, "lr": 0.001},
    )
    run_dir = config.parent / "runs" / "scale"
    up = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "up", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(config.parent / "up.log").open("wb"),
    )
    try:
        address_file = run_dir / "controller.address"  # written by `relayrl up` for operator commands
        wait(address_file.exists, 120, "the controller")
        address = address_file.read_text()
        monkeypatch.setenv("RELAYRL_CONTROLLER", address)
        client = RelayClient(address)
        wait(lambda: client.status().trainer_step >= 2, 180, "training to pass step 2")

        # Paused, so that the run cannot end while the new worker starts (a few seconds on this machine).
        assert relay("pause", "--reason", "scale up")["state"] == "paused"
        assert relay("scale", "rollout", "2")["replicas"] == 2
        seen = []  # (controller version, rollout-1 version, rollout-1 generated tokens)

        def rollout1_current() -> bool:
            weights = client.weights_status()
            for w in weights.workers:
                if w.worker_id == "rollout-1" and not w.error:
                    seen.append((weights.policy_version, w.policy_version, w.generated_tokens))
                    return w.policy_version == weights.policy_version
            return False

        wait(rollout1_current, 90, "rollout-1 to receive the current weights")
        assert_roles_forked(load_config(config), up.pid)  # the worker the scaler started too
        assert seen[-1][2] == 0  # registered at version 0, brought to the current version before any work
        joiners = [s for s in client.weights_status().recent_syncs if s.reason in ("joiners", "step")]
        assert any("rollout-1" in s.synced_worker_ids for s in joiners)

        forced = relay("weights", "sync", "--force")["sync"]  # the trainer answers while paused
        assert forced["reason"] == "operator-force" and sorted(forced["synced_worker_ids"]) == [
            "rollout-0",
            "rollout-1",
        ]

        version = client.status().policy_version
        assert relay("resume")["state"] == "running"
        results = list(client.submit([f"{d} + 1 =" for d in range(8)], SamplingParams(n=2, max_tokens=4)))
        assert len(results) == 16 and min(c.policy_version for c in results) >= version >= 2
        wait(lambda: rollout1_current() and seen[-1][2] > 0, 60, "rollout-1 to generate")
        assert all(tokens == 0 for _, worker_version, tokens in seen if worker_version < 1), seen

        assert relay("scale", "rollout", "1")["replicas"] == 1  # under load: drained, then stopped
        wait(lambda: [w.worker_id for w in client.status().workers] == ["rollout-0"], 60, "rollout-1 to stop")

        assert relay("pause")["state"] == "paused"
        time.sleep(1.0)  # the step in progress completes
        step = client.status().trainer_step
        time.sleep(2.0)
        assert client.status().trainer_step <= step + 1, "training went on while paused"
        assert relay("resume")["state"] == "running"

        assert up.wait(timeout=240) == 0, (config.parent / "up.log").read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=60)

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # synchronous: step s trains data of version s - 1 only, nothing stale
        assert r["rollout_version_min"] == r["step"] - 1 and r["groups_stale"] == 0
    assert any(r["workers_synced"] == 2 for r in records) and records[-1]["workers_synced"] == 1

    ledger = final_ledger(run_dir / "controller" / "ledger.jsonl")
    states = {state for state, _ in ledger.values()}
    assert states <= {"trained", "filtered", "failed"}, f"prompts left {states - {'trained', 'filtered', 'failed'}}"
    assert all(reason for state, reason in ledger.values() if state in ("filtered", "failed"))
    assert sum(state == "trained" for state, _ in ledger.values()) == STEPS * 4
    assert "scale down: stopping rollout-1" in (config.parent / "up.log").read_text()


def test_drain_under_up_keeps_the_worker_gone_and_status_shows_the_run(make_config, monkeypatch):
    """One short ``relayrl up`` run (2 workers, 1 trainer rank). ``status`` shows step/total, recent reward,
    samples/s, ETA and the last step's rollout-correction diagnostics, and ``--watch`` refreshes it. An operator
    drains rollout-1 and stops it at once, as the drain message used to tell: the supervisor does not restart it,
    its slot is given up (desired 1), status lists it as drained, and training goes on with rollout-0. ``resume``
    says it is the alias of ``unpause``."""
    steps = 400  # the run is stopped long before
    config = make_config("drain", controller={"dynamic_sampling": False}, trainer={"steps": steps, "nproc": 1})
    cfg = load_config(config)
    log = config.parent / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "up", str(config)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    try:
        address_file = cfg.run_dir / "controller.address"
        wait(address_file.exists, 120, "the controller")
        monkeypatch.setenv("RELAYRL_CONTROLLER", address_file.read_text())
        client = RelayClient(address_file.read_text())  # the waits poll in process; the CLI's output is asserted
        wait(lambda: client.status().trainer_step >= 2, 180, "training to pass step 2")
        status = relay("status")
        assert status["total_steps"] == steps and status["recent_steps"] >= 1, status
        assert status["recent_reward"] is not None and status["samples_per_second"] > 0 < status["eta_seconds"]
        human = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", "status"], capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        for shown in (f"/{steps} (", "recent reward", "samples/s", "ETA", "drained", "rollout correction at step"):
            assert shown in human.stdout, human.stdout
        diagnostics = {k.removeprefix("rollout_corr/") for k in status["step_metrics"]}  # the last step's
        assert {
            "kl_k1", "kl_k3", "chi2_token", "chi2_seq", "log_ppl_diff", "ess", "rejected_token_share",
            "rejected_seq_share", "is_weight_mean", "is_weight_max", "is_weight_min",
        } <= diagnostics, status  # fmt: skip
        watch = subprocess.Popen(
            [sys.executable, "-m", "relayrl.cli", "status", "--watch", "0.2", "--json"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        frames = [json.loads(watch.stdout.readline()) for _ in range(3)]
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0, watch.stderr.read()
        assert all(f["total_steps"] == steps and f["state"] == "running" for f in frames)

        worker = supervised_roles(cfg)["rollout-1"]["pid"]
        assert relay("drain", "rollout-1")["state"] == "draining"
        with contextlib.suppress(ProcessLookupError):  # a worker with nothing in flight may have left already
            os.kill(worker, signal.SIGTERM)  # what the old message told the operator to do
        wait(lambda: list(client.status().drained_workers) == ["rollout-1"], 60, "rollout-1 listed as drained")
        step = client.status().trainer_step
        wait(lambda: client.status().trainer_step >= step + 3, 180, "three more steps")
        status = relay("status")
        assert [w["worker_id"] for w in status["workers"]] == ["rollout-0"], status["workers"]
        assert status["desired_rollout_replicas"] == 1 and status["drained_workers"] == ["rollout-1"]
        assert "rollout-1" not in supervised_roles(cfg)
        text = log.read_text()
        assert "drain: rollout-1 drained by an operator" in text and "rollout-1 restarted" not in text, text[-3000:]

        alias = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", "resume", "--json"], capture_output=True, text=True, timeout=60,
            cwd=ROOT,
        )  # fmt: skip
        assert alias.returncode == 0 and json.loads(alias.stdout)["state"] == "running", alias.stderr
        assert "alias of relayrl unpause" in alias.stderr
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, log.read_text()[-3000:]
