"""Scaling the rollout workers of a running relayrl Slurm het job (``relayrl scale rollout N --slurm-job ID``).

deploy/slurm/relayrl.sbatch starts the job's own workers as one step, ``relayrl-rollout``, in het group 0.
Scaling up adds one step per extra worker, ``relayrl-rollout-<k>`` (k counts on from the job's own
workers: with 2, the first extra is ``relayrl-rollout-2``), launched with ``srun --jobid=<id> --het-group=0
--overlap`` running the same step script (``$RUN_DIR/relayrl.sbatch __step rollout``) on a node of het
group 0, round-robin, on a port no other worker of that node uses (from ``$RUN_DIR/roles``). The extra
worker's id is its step name. srun is detached (own session, output in
``$RUN_DIR/logs/rollout-scale-<k>.log``); the command returns once the step exists. The worker registers
at version 0 and the trainer pushes it the current weights. The desired count is recorded in the
controller (ScaleRollout) after the steps were started or stopped.

Scaling down drains the highest extra workers through the controller (DrainWorker), waits until they
have nothing in flight, then sends SIGTERM to their steps (``scancel --signal=TERM <jobid>.<stepid>``;
the worker deregisters) and waits for the steps to end (a hard ``scancel`` after the drain timeout).
The job's own workers are one step and are never removed: N below their count is refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STEP_NAME = "relayrl-rollout"
EXTRA = re.compile(rf"^{STEP_NAME}-(\d+)$")
COMMENT = "relayrl_run_dir="


class SlurmError(RuntimeError):
    """A Slurm command failed or the job is not a running relayrl het job."""


def _run(*cmd: str) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]}: not found (Slurm client commands must be on PATH)") from None
    if res.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)}: {res.stderr.strip() or f'exit code {res.returncode}'}")
    return res.stdout


def job_records(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job -o`` of every component of a (het) job, as key -> value."""
    records = []
    for line in _run("scontrol", "show", "job", "-o", job_id).splitlines():
        if line.strip():
            records.append(dict(re.findall(r"(\w+)=(\S*)", line)))
    if not records:
        raise SlurmError(f"job {job_id}: not found")
    return records


@dataclass
class SlurmJob:
    job_id: str  # the het job's id (= het group 0's job id)
    group_ids: list[str]  # job id of each het component, by offset
    run_dir: Path
    info: dict  # job.json
    rollout_nodes: list[str]
    base_tasks: int  # tasks of het group 0: the job's own workers, one step

    @property
    def controller(self) -> str:
        return self.info["controller"]


def find_job(job_id: str, run_dir: str | None = None) -> SlurmJob:
    """The running het job and its run directory (``run_dir``, else the job's ``Comment=relayrl_run_dir=...``
    that relayrl.sbatch sets, else RELAYRL_RUN_DIR, else the sbatch default ``<WorkDir>/runs/slurm-<id>``),
    which must hold the job.json the sbatch writes."""
    records = job_records(job_id)
    leader = next((r for r in records if r.get("HetJobOffset", "0") == "0"), records[0])
    states = {r.get("JobState") for r in records}
    if states != {"RUNNING"}:
        raise SlurmError(f"job {job_id}: not running (state {', '.join(sorted(s or '?' for s in states))})")
    het_id = leader.get("HetJobId") or leader["JobId"]
    ordered = sorted(records, key=lambda r: int(r.get("HetJobOffset", "0")))
    group_ids = [r["JobId"] for r in ordered]
    candidates = [run_dir] if run_dir else []
    comment = next((r.get("Comment", "") for r in records if r.get("Comment", "").startswith(COMMENT)), "")
    if not run_dir and comment:  # the sbatch records its run directory there
        candidates.append(comment[len(COMMENT) :])
    if not run_dir and os.environ.get("RELAYRL_RUN_DIR"):
        candidates.append(os.environ["RELAYRL_RUN_DIR"])
    if not run_dir and leader.get("WorkDir"):
        candidates.append(os.path.join(leader["WorkDir"], "runs", f"slurm-{het_id}"))
    for candidate in candidates:
        path = Path(candidate)
        if not path.is_absolute() and leader.get("WorkDir"):
            path = Path(leader["WorkDir"]) / path
        job_json = path / "job.json"
        if job_json.exists():
            info = json.loads(job_json.read_text())
            if str(info.get("job_id")) != het_id:
                continue
            tasks = int(ordered[0].get("NumTasks") or 0) or len(info.get("rollout_nodes") or []) or 1
            return SlurmJob(het_id, group_ids, path, info, list(info.get("rollout_nodes") or []), tasks)
    tried = ", ".join(candidates) or "nothing"
    raise SlurmError(f"job {het_id}: no job.json of this job found (tried {tried}); pass --slurm-run-dir")


def steps(job: SlurmJob) -> dict[str, list[str]]:
    """Running steps of the job: name -> ["jobid.stepid", ...]."""
    out = _run("squeue", "-s", "-h", "-j", ",".join(job.group_ids), "-o", "%i %j")
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            found.setdefault(parts[1], []).append(parts[0])
    return found


def role_files(job: SlurmJob) -> list[dict]:
    """Records of roles/rollout.*.json: the job's own tasks (rollout.<procid>.json) and the extra
    workers (rollout.scale-<k>.json). The sbatch writes each atomically (a .tmp renamed): one that cannot be read
    is damaged, not being written, and is a SlurmError naming it (skipped, its worker's port could be taken)."""
    records = []
    for path in sorted((job.run_dir / "roles").glob("rollout.*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise SlurmError(f"{path}: unreadable worker record ({err}); fix or remove it") from None
    return records


def extra_workers(job: SlurmJob, running: dict[str, list[str]] | None = None) -> dict[int, list[str]]:
    """k -> step ids of the running ``relayrl-rollout-<k>`` steps."""
    running = steps(job) if running is None else running
    return {int(m.group(1)): ids for name, ids in running.items() if (m := EXTRA.match(name))}


def _port(address: str) -> int | None:
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


@dataclass
class Plan:
    start: list[int] = field(default_factory=list)  # k of workers to launch
    stop: list[int] = field(default_factory=list)  # k of workers to drain and stop


def plan(replicas: int, n_base: int, extras: list[int]) -> Plan:
    """Which ``relayrl-rollout-<k>`` to start or stop so that n_base + extras == replicas."""
    if replicas < n_base:
        raise ValueError(f"replicas: the job's own {n_base} workers are one step and stay; scale to {n_base} or more")
    extras = sorted(extras)
    want = replicas - n_base
    if want < len(extras):
        return Plan(stop=sorted(extras[want:], reverse=True))
    free = (k for k in range(n_base, n_base + replicas + len(extras)) if k not in extras)
    return Plan(start=[next(free) for _ in range(want - len(extras))])


def launch(job: SlurmJob, k: int, *, taken_ports: dict[str, set[int]]) -> dict:
    """Start ``relayrl-rollout-<k>`` as a detached srun in het group 0; returns what was started."""
    nodes = job.rollout_nodes
    if not nodes:
        raise SlurmError(f"{job.run_dir}/job.json names no rollout nodes")
    node = nodes[(k - job.base_tasks) % len(nodes)]
    used = taken_ports.setdefault(node, set())
    port = max(used, default=int(os.environ.get("RELAYRL_ROLLOUT_PORT", "50052")) - 1) + 1
    while port in used:
        port += 1
    used.add(port)
    name = f"{STEP_NAME}-{k}"
    master = job.info.get("master", "")
    # never an outer job's context (SLURM_JOB_ID etc. would redirect srun); SLURM_CONF stays
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith("SLURM_") or k_ == "SLURM_CONF"}
    env.update(
        RELAYRL_CONFIG=job.info["config"],
        RELAYRL_RUN_DIR=str(job.run_dir),
        RELAYRL_CONTROLLER=job.controller,
        RELAYRL_MASTER_ADDR=master.rsplit(":", 1)[0],
        RELAYRL_PYTHON=job.info.get("python") or os.environ.get("RELAYRL_PYTHON") or sys.executable,
        RELAYRL_HET_GROUP="0",
        RELAYRL_ROLLOUT_PORT=str(port),
        RELAYRL_ROLLOUT_METRICS_PORT="",
        RELAYRL_ROLE_ID=f"scale-{k}",
        RELAYRL_ROLLOUT_ARGS=f"{os.environ.get('RELAYRL_ROLLOUT_ARGS', '')} --worker-id {name}".strip(),
    )
    log_path = job.run_dir / "logs" / f"rollout-scale-{k}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        "srun",
        f"--jobid={job.job_id}",
        "--het-group=0",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={name}",
        "bash",
        str(job.run_dir / "relayrl.sbatch"),
        "__step",
        "rollout",
    ]
    with log_path.open("ab") as sink:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    started = {"worker_id": name, "node": node, "port": port, "srun_pid": proc.pid, "log": str(log_path)}
    deadline = time.monotonic() + 60.0
    while name not in steps(job):  # srun got its step (or failed: say why)
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            why = f"srun exited with {proc.returncode}" if proc.poll() is not None else "no step after 60s"
            raise SlurmError(f"{name}: {why}; {log_path}: " + " | ".join(tail))
        time.sleep(0.5)
    return started


def ports_in_use(job: SlurmJob) -> dict[str, set[int]]:
    """node -> rollout ports its workers (the job's own and the extra ones) advertise."""
    own = [p for p in (job.run_dir / "roles").glob("rollout.*.json") if p.name.split(".")[1].isdigit()]
    if len(own) < job.base_tasks:  # their ports are not known yet: a new worker could take one
        raise SlurmError(f"job {job.job_id}: {len(own)} of its {job.base_tasks} rollout workers started; retry")
    taken: dict[str, set[int]] = {}
    for r in role_files(job):
        port = _port(r.get("address", ""))
        if port is not None:
            taken.setdefault(r.get("slurmd_nodename") or "", set()).add(port)
    return taken


def wait_steps_gone(job: SlurmJob, names: list[str], timeout_s: float) -> list[str]:
    """Until no step with one of ``names`` runs; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [n for n in names if n in steps(job)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def stop_steps(job: SlurmJob, extras: dict[int, list[str]], timeout_s: float) -> None:
    """SIGTERM to the steps of the given extra workers (they deregister), a hard cancel of those still
    running after ``timeout_s``; then their role files go."""
    ids = [i for step_ids in extras.values() for i in step_ids]
    if not ids:
        return
    _run("scancel", "--quiet", "--signal=TERM", *ids)
    names = [f"{STEP_NAME}-{k}" for k in extras]
    if wait_steps_gone(job, names, timeout_s):
        _run("scancel", "--quiet", *ids)
        wait_steps_gone(job, names, 30.0)
    for k in extras:
        (job.run_dir / "roles" / f"rollout.scale-{k}.json").unlink(missing_ok=True)
