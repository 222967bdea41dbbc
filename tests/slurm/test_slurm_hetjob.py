"""Slurm deployment: a real three-node Slurm cluster on this host, heterogeneous jobs on it.

The cluster comes from ``deploy/slurm/local-cluster.sh`` (Debian's slurm-wlm + munge, no systemd:
munged as user munge, slurmctld, and ``slurmd -N n1`` .. ``slurmd -N n3`` with NodeAddr=127.0.0.1 and
distinct ports; a het job's components share no node, so a third node for a third het group), everything under
a fresh directory in /tmp: one cluster for the session, shared with test_slurm_scale (``cluster`` in
conftest.py), torn down at its end.

There is no slurmdbd, so final job states come from ``JobCompType=jobcomp/filetxt`` (one line per het
component), with ``scontrol show job`` used while the job runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from relayrl.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = REPO / "deploy" / "slurm" / "local-cluster.sh"
SBATCH = REPO / "deploy" / "slurm" / "relayrl.sbatch"
STUB_CLI = Path(__file__).with_name("stub_cli.py")
DIGITS_SLURM = REPO / "examples" / "digits-slurm.yaml"

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one Slurm cluster on this host: one xdist worker


def _install_skip_reason() -> str | None:
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return None
    if sys.platform != "linux":
        return "Slurm test cluster needs Linux"
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it (apt-get install slurm-wlm munge) needs root"
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it with"
    return None


@dataclass
class Cluster:
    base: Path
    env: dict[str, str]
    timings: dict[str, float]

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, **kw)

    def submit(self, script: Path, *, cwd: Path, env: dict[str, str] | None = None, args=()) -> str:
        res = self.run("sbatch", "--parsable", *args, str(script), cwd=cwd, env={**self.env, **(env or {})})
        assert res.returncode == 0, f"sbatch failed: {res.stderr}"
        return res.stdout.strip().split(";")[0]

    def components(self, job_id: str) -> list[dict[str, str]]:
        """Final records of a (het) job's components from the jobcomp text file."""
        path = self.base / "log" / "jobcomp.txt"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            rec = dict(re.findall(r"(\w+)=(\S*)", line))
            plain_job = rec.get("JobId") == job_id and rec.get("HetJobId", "0") == "0"
            if rec.get("HetJobId") == job_id or plain_job:
                out.append(rec)
        return sorted(out, key=lambda r: int(r.get("HetJobOffset", "0")))

    def live_states(self, job_id: str) -> list[str]:
        res = self.run("scontrol", "show", "job", "-o", job_id)
        return re.findall(r"JobState=(\S+)", res.stdout) if res.returncode == 0 else []

    def wait(self, job_id: str, timeout: float) -> list[dict[str, str]]:
        """Wait until every component has a final record; returns the records (sorted by offset)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.live_states(job_id)
            comps = self.components(job_id)
            if states and all(s in TERMINAL for s in states) and len(comps) >= len(states):
                return comps
            if not states and comps:
                return comps
            time.sleep(0.5)
        self.run("scancel", job_id)
        pytest.fail(f"job {job_id} did not finish in {timeout:.0f}s; states {self.live_states(job_id)}")


def test_cluster_has_three_idle_nodes(cluster: Cluster):
    res = cluster.run("sinfo", "-h", "-N", "-o", "%N %t")
    assert res.returncode == 0, res.stderr
    nodes = dict(line.split() for line in res.stdout.splitlines())
    assert nodes == {"n1": "idle", "n2": "idle", "n3": "idle"}


TRIVIAL_HETJOB = """#!/bin/bash
#SBATCH --job-name=het-trivial
#SBATCH --output={out}/slurm-%j.out
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
set -euo pipefail
for g in 0 1; do
  srun --het-group=$g bash -c 'echo "group=$1 node=$SLURMD_NODENAME nodelist=$SLURM_JOB_NODELIST \\
het_size=$SLURM_HET_SIZE job=$SLURM_JOB_ID" > "$2/group$1.txt"' _ $g {out}
done
"""


def test_trivial_hetjob(cluster: Cluster, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "het.sbatch"
    script.write_text(TRIVIAL_HETJOB.format(out=out))
    t0 = time.monotonic()
    job = cluster.submit(script, cwd=tmp_path)
    comps = cluster.wait(job, timeout=120)
    elapsed = time.monotonic() - t0
    print(f"\ntrivial het job {job}: {elapsed:.1f}s submit-to-done", file=sys.stderr)

    assert [c["HetJobOffset"] for c in comps] == ["0", "1"], comps
    assert all(c["JobState"] == "COMPLETED" and c["ExitCode"] == "0:0" for c in comps), comps
    assert comps[0]["NodeList"] != comps[1]["NodeList"]
    seen = {}
    for g in (0, 1):
        fields = dict(kv.split("=", 1) for kv in (out / f"group{g}.txt").read_text().split())
        assert fields["het_size"] == "2"
        assert fields["node"] == comps[g]["NodeList"]  # the step ran inside its own het component
        seen[g] = fields["node"]
    assert seen[0] != seen[1]


# ------------------------------------------------------------------------------------------------
# deploy/slurm/relayrl.sbatch
# ------------------------------------------------------------------------------------------------


def _relayrl_env(run_dir: Path, config: str) -> dict[str, str]:
    return {
        "RELAYRL_CONFIG": config,
        "RELAYRL_RUN_DIR": str(run_dir),
        "RELAYRL_PYTHON": sys.executable,
        "RELAYRL_CONTROLLER_PORT": str(free_port("0.0.0.0")),
        "RELAYRL_CONTROLLER_METRICS_PORT": str(free_port("0.0.0.0")),
        "RELAYRL_ROLLOUT_PORT": str(free_port("0.0.0.0", count=2)),
        "RELAYRL_ROLLOUT_METRICS_PORT": str(free_port("0.0.0.0", count=2)),
        "RELAYRL_MASTER_PORT": str(free_port("0.0.0.0")),
        "RELAYRL_STOP_GRACE": "30",
    }


def _diagnostics(run_dir: Path, out_dir: Path) -> str:
    parts = []
    for f in sorted([*out_dir.glob("*.out"), *(run_dir / "logs").glob("*.log")]):
        parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


def _roles(run_dir: Path) -> dict[str, list[dict]]:
    roles: dict[str, list[dict]] = {}
    for f in sorted((run_dir / "roles").glob("*.json")):
        rec = json.loads(f.read_text())
        roles.setdefault(rec["role"], []).append(rec)
    return roles


@dataclass
class RelayrlJob:
    job_id: str
    components: list[dict[str, str]]
    run_dir: Path
    diag: str


def _submit_relayrl(
    cluster: Cluster, tmp_path: Path, *, cwd: Path, config: str, timeout: float, env=None, args=()
) -> RelayrlJob:
    run_dir = tmp_path / "run"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    full_env = {**_relayrl_env(run_dir, config), **(env or {})}
    t0 = time.monotonic()
    job = cluster.submit(SBATCH, cwd=cwd, env=full_env, args=(f"--output={out_dir}/slurm-%j.out", *args))
    comps = cluster.wait(job, timeout=timeout)
    print(f"\nrelayrl het job {job}: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return RelayrlJob(job, comps, run_dir, _diagnostics(run_dir, out_dir))


def _assert_placement(job: RelayrlJob, scorers: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Rollout ran in het group 0, controller and trainer in het group 1, on disjoint nodes; each of ``scorers``
    (role reward-<name>) in het group 1 beside the controller."""
    roles = _roles(job.run_dir)
    scorer_roles = {f"reward-{name}" for name in scorers}
    assert set(roles) == {"controller", "rollout", "trainer", *scorer_roles}, f"{roles}\n{job.diag}"
    groups = {role: {r["het_group"] for r in recs} for role, recs in roles.items()}
    assert groups == {"controller": {1}, "rollout": {0}, "trainer": {1}} | {role: {1} for role in scorer_roles}, groups
    for recs in roles.values():  # the group the script asked for is the one Slurm placed the task in
        for r in recs:
            assert r["het_group_from_nodelist"] == r["het_group"], r
            assert r["het_size"] == 2, r
    rollout_nodes = {r["slurmd_nodename"] for r in roles["rollout"]}
    trainer_nodes = {r["slurmd_nodename"] for r in roles["trainer"]}
    assert rollout_nodes.isdisjoint(trainer_nodes)
    assert roles["controller"][0]["slurmd_nodename"] == sorted(trainer_nodes)[0]
    for role in scorer_roles:
        assert [r["slurmd_nodename"] for r in roles[role]] == [roles["controller"][0]["slurmd_nodename"]]
    return roles


def _assert_completed(job: RelayrlJob, groups: int = 2) -> None:
    comps = job.components
    assert len(comps) == groups, f"{comps}\n{job.diag}"
    assert all(c["JobState"] == "COMPLETED" and c["ExitCode"] == "0:0" for c in comps), f"{comps}\n{job.diag}"
    assert json.loads((job.run_dir / "job.json").read_text())["trainer_exit_code"] == 0


def _assert_reward_improves(job: RelayrlJob) -> None:
    path = job.run_dir / "metrics.jsonl"
    assert path.exists(), f"no {path}\n{job.diag}"
    rewards = [json.loads(line)["reward_mean"] for line in path.read_text().splitlines() if line.strip()]
    assert len(rewards) >= 10, rewards
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert last > first, f"reward_mean did not improve: first 5 {first:.4f}, last 5 {last:.4f}"


@pytest.fixture
def stub_workdir(tmp_path: Path) -> Path:
    """A submit directory where `python -m relayrl.cli` is tests/slurm/stub_cli.py."""
    work = tmp_path / "work"
    (work / "relayrl").mkdir(parents=True)
    (work / "relayrl" / "__init__.py").write_text("")
    shutil.copy(STUB_CLI, work / "relayrl" / "cli.py")
    (work / "config.yaml").write_text("run: {name: stub}\n")
    return work


def test_relayrl_sbatch_with_stub_cli(cluster: Cluster, tmp_path: Path, stub_workdir: Path):
    """The orchestration of relayrl.sbatch (placement, addresses, flags, clean stop) on a stand-in CLI.

    Two rollout tasks on the rollout node (het sizes given on the sbatch command line, `:` between
    groups) check the per-task ports. The config's scorer (scorers.rm) is served as a step of its own, started
    before the controller, its address given to every role and joined to the controller.
    """
    (stub_workdir / "config.yaml").write_text("run: {name: stub}\nscorers: {rm: {model: m}}\n")
    job = _submit_relayrl(
        cluster,
        tmp_path,
        cwd=stub_workdir,
        config="config.yaml",
        timeout=300,
        args=("--ntasks-per-node=2", ":", "--nodes=1"),
    )
    _assert_completed(job)
    roles = _assert_placement(job, scorers=("rm",))
    assert len(roles["rollout"]) == 2 and len({r["address"] for r in roles["rollout"]}) == 2
    ctl, (scorer,) = roles["controller"][0], roles["reward-rm"]
    registered = [line.split() for line in (job.run_dir / "controller" / "registrations.txt").read_text().splitlines()]
    rollouts_registered = sorted(line[1] for line in registered if line[0] == "register")
    assert sorted(r["address"] for r in roles["rollout"]) == rollouts_registered
    assert [line for line in registered if line[0] == "scorer"] == [["scorer", "rm", scorer["address"]]]
    assert all(r["address"].rsplit(":", 1)[0] == ctl["address"].rsplit(":", 1)[0] for r in roles["rollout"])
    # the exact command lines of the contract
    argv = {}
    for f in (job.run_dir / "stub").glob("*.argv.json"):
        argv.setdefault(f.name.split("-")[0], []).append(json.loads(f.read_text())["argv"])
    assert len(argv["controller"]) == 1 and len(argv["rollout"]) == 2 and len(argv["trainer"]) == 1
    assert len(argv["reward"]) == 1
    ctl_argv, trainer_argv, scorer_argv = argv["controller"][0], argv["trainer"][0], argv["reward"][0]
    assert ctl_argv[:2] == ["controller", "serve"] and "--metrics-port" in ctl_argv
    assert "controller.host=0.0.0.0" in ctl_argv
    assert all(a[:2] == ["rollout", "serve"] and "--metrics-port" in a for a in argv["rollout"])
    assert trainer_argv[:2] == ["trainer", "run"]
    assert scorer_argv[:2] == ["reward", "serve"] and "--metrics-port" in scorer_argv
    assert scorer_argv[scorer_argv.index("--name") + 1] == "rm"
    assert scorer_argv[scorer_argv.index("--advertise") + 1] == scorer["address"]
    assert scorer_argv[scorer_argv.index("--controller") + 1] == ctl["address"]
    for a in [ctl_argv, trainer_argv, *argv["rollout"]]:  # every role started after it reaches the scorer
        assert f"scorers.rm.servers=[{scorer['address']}]" in a
    for a in [ctl_argv, trainer_argv, scorer_argv, *argv["rollout"]]:
        assert a[a.index("--config") + 1] == str(stub_workdir / "config.yaml")
        assert f"run.name={job.run_dir.name}" in a
    # the services were stopped with SIGTERM after the trainer finished, and exited cleanly
    assert (job.run_dir / "controller" / "stopped").read_text() == "SIGTERM\n", job.diag
    assert len(list((job.run_dir / "stub").glob("rollout-*.stopped"))) == 2, job.diag
    assert len(list((job.run_dir / "stub").glob("reward-rm-*.stopped"))) == 1, job.diag
    assert set(json.loads((job.run_dir / "supervisor.json").read_text())["roles"]) == {
        "controller",
        "rollout",
        "reward-rm",
    }
    _assert_reward_improves(job)


def test_relayrl_sbatch_trainer_failure_fails_job(cluster: Cluster, tmp_path: Path, stub_workdir: Path):
    job = _submit_relayrl(
        cluster,
        tmp_path,
        cwd=stub_workdir,
        config="config.yaml",
        timeout=300,
        # also: empty metrics ports drop the --metrics-port flags
        env={
            "RELAYRL_STUB_TRAINER_EXIT": "5",
            "RELAYRL_CONTROLLER_METRICS_PORT": "",
            "RELAYRL_ROLLOUT_METRICS_PORT": "",
        },
    )
    for f in (job.run_dir / "stub").glob("*.argv.json"):
        assert "--metrics-port" not in json.loads(f.read_text())["argv"], f.name
    assert [c["JobState"] for c in job.components] == ["FAILED", "FAILED"], f"{job.components}\n{job.diag}"
    assert json.loads((job.run_dir / "job.json").read_text())["trainer_exit_code"] != 0
    assert (job.run_dir / "controller" / "stopped").exists(), job.diag  # services still stopped cleanly


def test_relayrl_sbatch_rollout_crash_stops_trainer(cluster: Cluster, tmp_path: Path, stub_workdir: Path):
    t0 = time.monotonic()
    job = _submit_relayrl(
        cluster,
        tmp_path,
        cwd=stub_workdir,
        config="config.yaml",
        timeout=300,
        # one restart, soon: the restart and the exhausted budget, without the default budget's backoffs (1+2+4 s)
        env={"RELAYRL_STUB_ROLLOUT_CRASH": "1", "RELAYRL_MAX_RESTARTS": "1", "RELAYRL_RESTART_BACKOFF": "0.2"},
    )
    assert time.monotonic() - t0 < 120, "the waiting trainer was not stopped"
    assert [c["JobState"] for c in job.components] == ["FAILED", "FAILED"], f"{job.components}\n{job.diag}"
    assert "restart 1/1" in job.diag and "after 1 restarts (budget 1); stopping the trainer" in job.diag, job.diag


def _kill_a_step_mid_run(
    cluster: Cluster, tmp_path: Path, stub_workdir: Path, step: str, joined: str, env: dict[str, str], args=()
) -> RelayrlJob:
    """Submit the stub job with ``env`` added, SIGKILL its step named ``step`` once the controller has a line starting
    with ``joined`` (the step's first registration), and wait for the job's end."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    out_dir.mkdir()
    env = {**_relayrl_env(run_dir, "config.yaml"), **env}
    job_id = cluster.submit(SBATCH, cwd=stub_workdir, env=env, args=(f"--output={out_dir}/slurm-%j.out", *args))
    registrations = run_dir / "controller" / "registrations.txt"
    deadline = time.monotonic() + 180
    while not (registrations.exists() and joined in registrations.read_text()):
        assert time.monotonic() < deadline, _diagnostics(run_dir, out_dir)
        time.sleep(0.5)
    # every step of the session's cluster: a het group's steps carry that group's job id, not the leader's
    steps = cluster.run("squeue", "-s", "-h", "-o", "%i %j").stdout.split("\n")
    ids = [line.split()[0] for line in steps if line.endswith(f" {step}")]
    assert len(ids) == 1, steps
    assert cluster.run("scancel", "--signal=KILL", ids[0]).returncode == 0
    return RelayrlJob(job_id, cluster.wait(job_id, timeout=300), run_dir, _diagnostics(run_dir, out_dir))


def test_relayrl_sbatch_restarts_a_killed_rollout_step(cluster: Cluster, tmp_path: Path, stub_workdir: Path):
    """SIGKILL the rollout step mid-run: the batch script starts it again in het group 0, the worker registers
    again, and the job still COMPLETES; the restart is counted where `relayrl status` reads it."""
    env = {"RELAYRL_STUB_TRAINER_REGISTRATIONS": "2"}
    job = _kill_a_step_mid_run(cluster, tmp_path, stub_workdir, "relayrl-rollout", "register ", env)
    _assert_completed(job)
    assert "restart 1/" in job.diag
    assert json.loads((job.run_dir / "supervisor.json").read_text())["roles"]["rollout"]["restarts"] == 1
    assert {r["het_group"] for r in _roles(job.run_dir)["rollout"]} == {0}


def test_relayrl_sbatch_serves_a_scorer_in_a_third_het_group_and_restarts_it_killed(
    cluster: Cluster, tmp_path: Path, stub_workdir: Path
):
    """RELAYRL_SCORER_HET_GROUP=2 with a third het group on the sbatch line: the scorer step runs in that group, its
    address given to every role. SIGKILL it mid-run: the batch script starts it again in group 2, it joins the
    controller again (the stub trainer waits for that second join), and the job COMPLETES; the restart is counted
    where `relayrl status` reads it, and the restarted scorer is stopped with SIGTERM at the end."""
    (stub_workdir / "config.yaml").write_text("run: {name: stub}\nscorers: {rm: {model: m}}\n")
    env = {"RELAYRL_SCORER_HET_GROUP": "2", "RELAYRL_SCORER_PORT": str(free_port("0.0.0.0"))}
    env |= {"RELAYRL_STUB_TRAINER_SCORER_JOINS": "2", "RELAYRL_RESTART_BACKOFF": "0.2"}
    groups = (":", "--nodes=1", ":", "--nodes=1")  # a third het group, of one node, for the scorer
    job = _kill_a_step_mid_run(cluster, tmp_path, stub_workdir, "relayrl-reward-rm", "scorer rm ", env, args=groups)
    _assert_completed(job, groups=3)
    assert "reward-rm step ended" in job.diag and "restart 1/" in job.diag, job.diag
    restarts = json.loads((job.run_dir / "supervisor.json").read_text())["roles"]
    assert {role: r["restarts"] for role, r in restarts.items()} == {"controller": 0, "rollout": 0, "reward-rm": 1}
    (scorer,) = _roles(job.run_dir)["reward-rm"]  # the restarted task's record
    assert (scorer["het_group"], scorer["het_group_from_nodelist"], scorer["het_size"]) == (2, 2, 3), scorer
    assert scorer["step_nodelist"] == scorer["group_nodelist"] == scorer["slurmd_nodename"], scorer  # group 2's node
    registered = (job.run_dir / "controller" / "registrations.txt").read_text().splitlines()
    assert [line for line in registered if line.startswith("scorer ")] == [f"scorer rm {scorer['address']}"] * 2
    argv = [json.loads(f.read_text())["argv"] for f in (job.run_dir / "stub").glob("*.argv.json")]
    servers = f"scorers.rm.servers=[{scorer['address']}]"
    assert all(servers in a for a in argv if a[0] in ("controller", "rollout", "trainer")), argv
    assert len(list((job.run_dir / "stub").glob("reward-rm-*.stopped"))) == 1, job.diag


def one_thread_per_role(raw: dict) -> None:
    """Set a relayrl config's workers and trainer ranks to one torch thread each: both logical nodes are this host,
    and a role on a node of its own takes every core (relayrl/cores/threads.py), so the job's processes with a
    thread per core each spin-waited on each other's cores (a step took seconds instead of tenths)."""
    raw["rollout"]["threads"] = raw["trainer"]["threads"] = 1


def _cli_help(role: str) -> str:
    cmd = [sys.executable, "-m", "relayrl.cli", role, "serve", "--help"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.timeout(1200)
def test_relayrl_hetjob(cluster: Cluster, tmp_path: Path):
    """The real thing: relayrl's controller, rollout worker and torchrun trainer as one het job, with a served
    reward model (a tiny one, weighted 0 beside the task's reward: it is called every step, trains nothing) as a
    scorer step of its own."""
    from tests.unit.scorer_testing import write_tiny_reward_model

    raw = yaml.safe_load(DIGITS_SLURM.read_text())
    raw["scorers"] = {"rm": {"model": str(write_tiny_reward_model(tmp_path / "rm")), "precision": "float32"}}
    raw["controller"]["reward"] = {"fns": {raw["controller"]["reward"]["fn"]: 1.0, "scorer:rm": 0.0}}
    one_thread_per_role(raw)
    config = tmp_path / "digits-slurm-rm.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    # as many rollout workers as `relayrl up` would start, all on the rollout node
    workers = (raw.get("rollout") or {}).get("workers", 1)
    sizes = (f"--ntasks-per-node={workers}", ":", "--nodes=1")
    env = {"RELAYRL_SCORER_PORT": str(free_port("0.0.0.0")), "RELAYRL_SCORER_METRICS_PORT": str(free_port("0.0.0.0"))}
    for role in ("controller", "rollout"):  # the sbatch drops --metrics-port when its port is ""
        if "--metrics-port" not in _cli_help(role):
            env[f"RELAYRL_{role.upper()}_METRICS_PORT"] = ""
    job = _submit_relayrl(cluster, tmp_path, cwd=REPO, config=str(config), timeout=420, env=env, args=sizes)
    _assert_completed(job)
    _assert_placement(job, scorers=("rm",))
    _assert_reward_improves(job)
    steps = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    scored = [r for r in steps if r.get("scorer/rm/calls", 0) > 0]
    assert len(scored) == len(steps) and all(r["scorer/rm/retries"] == 0 for r in scored), job.diag
