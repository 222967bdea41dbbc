"""`relayrl scale rollout N --slurm-job ID` on a running relayrl.sbatch het job (the real CLI, controller,
workers and trainer on the local Slurm cluster of test_slurm_hetjob)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from test_slurm_hetjob import DIGITS_SLURM, REPO, SBATCH, Cluster, _diagnostics, _relayrl_env, one_thread_per_role

from relayrl.client import RelayClient
from relayrl.ops.render import to_dict

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one Slurm cluster on this host: one xdist worker

EXTRA = "relayrl-rollout-2"


def _cli(slurm: Cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "relayrl.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=timeout)


def _status(controller: str) -> dict | None:
    """What `relayrl status --json` prints, from the SDK in this process: a CLI process per poll took a core's
    worth of CPU from the job it polls."""
    try:
        with RelayClient(controller, timeout_s=5, attempts=1) as client:
            return to_dict(client.status())
    except grpc.RpcError:
        return None


def _wait_for(what: str, fn, timeout: float, diag):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{diag()}")


def _steps(slurm: Cluster, job_id: str) -> set[str]:
    ids = ",".join(re.findall(r"JobId=(\d+)", slurm.run("scontrol", "show", "job", "-o", job_id).stdout))
    res = slurm.run("squeue", "-s", "-h", "-j", ids, "-o", "%j")
    return set(res.stdout.split())


@pytest.mark.timeout(420)
def test_scale_rollout_slurm_job(cluster: Cluster, tmp_path: Path):
    config = yaml.safe_load(DIGITS_SLURM.read_text())
    config["trainer"]["steps"] = 100000  # runs until cancelled
    one_thread_per_role(config)
    config_path = tmp_path / "digits-long.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    env = {**_relayrl_env(run_dir, str(config_path)), "RELAYRL_CONTROLLER_METRICS_PORT": "", "RELAYRL_STOP_GRACE": "5"}
    env["RELAYRL_ROLLOUT_METRICS_PORT"] = ""
    sizes = ("--ntasks-per-node=2", ":", "--nodes=1")
    job = cluster.submit(SBATCH, cwd=REPO, env=env, args=(f"--output={out_dir}/slurm-%j.out", *sizes))
    diag = lambda: _diagnostics(run_dir, out_dir)  # noqa: E731
    try:
        _wait_for("job.json", lambda: (run_dir / "job.json").exists(), 90, diag)
        controller = json.loads((run_dir / "job.json").read_text())["controller"]

        def trained_with(n: int):
            s = _status(controller)
            ok = s and len(s["workers"]) == n and int(s["policy_version"]) >= 1
            return s if ok else None

        _wait_for("2 workers and a first trained step", lambda: trained_with(2), 150, diag)

        t0 = time.monotonic()
        res = _cli(cluster, "scale", "rollout", "3", "--slurm-job", job, "--json")
        assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{diag()}"
        info = json.loads(res.stdout)
        assert [s["worker_id"] for s in info["started"]] == [EXTRA], info
        assert info["job_workers"] == 2 and info["run_dir"] == str(run_dir), info
        assert EXTRA in _steps(cluster, job)

        def joined():  # the third worker registered and serves the current policy version
            s = _status(controller)
            if not s or s["desired_rollout_replicas"] != 3:
                return None
            w = next((w for w in s["workers"] if w["worker_id"] == EXTRA), None)
            cur = int(s["policy_version"])
            return w if w and w["state"] == "ready" and cur >= 1 and int(w["policy_version"]) >= cur - 1 else None

        worker = _wait_for(f"{EXTRA} to register at the current version", joined, 120, diag)
        print(f"\n{EXTRA} joined in {time.monotonic() - t0:.1f}s: {worker}", file=sys.stderr)

        def serving():  # it gets Generate calls
            s = _status(controller) or {"workers": []}
            return any(w["worker_id"] == EXTRA and w["tokens_per_second"] > 0 for w in s["workers"])

        _wait_for(f"{EXTRA} to generate", serving, 60, diag)
        comment = cluster.run("scontrol", "show", "job", "-o", job).stdout
        assert f"Comment=relayrl_run_dir={run_dir}" in comment  # how --slurm-job found the run directory
        role = json.loads((run_dir / "roles" / "rollout.scale-2.json").read_text())
        rollout_nodes = json.loads((run_dir / "job.json").read_text())["rollout_nodes"]
        assert role["het_group"] == 0 and role["slurmd_nodename"] in rollout_nodes and role["job_id"] == job, role
        assert (run_dir / "roles" / "rollout.0.json").exists() and (run_dir / "roles" / "rollout.1.json").exists()

        scale_down = ("scale", "rollout", "2", "--slurm-job", job, "--slurm-run-dir", str(run_dir), "--json")
        res = _cli(cluster, *scale_down, timeout=180)
        assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{diag()}"
        assert json.loads(res.stdout)["stopped"] == [EXTRA]
        assert EXTRA not in _steps(cluster, job)
        assert {"relayrl-rollout", "relayrl-controller", "relayrl-trainer"} <= _steps(cluster, job)  # untouched

        def left():
            s = _status(controller)
            ids = [w["worker_id"] for w in s["workers"]] if s else None
            return s if s and EXTRA not in ids and len(ids) == 2 and s["desired_rollout_replicas"] == 2 else None

        _wait_for(f"{EXTRA} to leave the registry", left, 30, diag)
        log = (run_dir / "logs" / "rollout-scale-2.log").read_text()
        assert f"SIGTERM: draining rollout worker {EXTRA}" in log, log[-3000:]  # stopped by SIGTERM, not killed
        assert not (run_dir / "roles" / "rollout.scale-2.json").exists()

        res = _cli(cluster, "scale", "rollout", "2", "--slurm-job", job)  # nothing to do; the table output
        assert res.returncode == 0 and f"slurm job {job}: rollout workers 2 -> 2" in res.stdout, res.stderr

        res = _cli(cluster, "scale", "rollout", "1", "--slurm-job", job)  # the job's own step stays
        assert res.returncode == 2 and "scale to 2 or more" in " ".join(res.stderr.split()), res.stderr
    finally:
        cluster.run("scancel", job)
        cluster.wait(job, timeout=90)
