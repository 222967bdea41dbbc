"""Helpers for tests that run a real local job (controller, workers, trainer) and break it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from relayrl.config import load_config
from relayrl.launcher import LocalJob, controller_status, start_forks, start_job
from relayrl.ops.placement import GPU_DRIVER_NODES
from relayrl.runtime.forkserver import ForkServer
from relayrl.runtime.procs import become_subreaper, child_pids, descendants, kill_tree, reap_orphans
from relayrl.runtime.runlock import process_start_ticks
from relayrl.trainer.metrics import read_metrics

FORK_SERVERS: list[ForkServer] = []  # of the test in progress: ``release_forks`` closes them after it


def launch(config_path: Path) -> tuple[LocalJob, object]:
    """``start_job`` in this process, each role forked from a fork server as ``relayrl up`` forks them
    (``start_forks``: torch imported once, not once per role). The server makes this process a child subreaper;
    ``release_forks`` (tests/integration/conftest.py, after each test) ends that, so the processes of later tests
    are orphaned to init as usual."""
    cfg = load_config(config_path)
    (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    run_config = cfg.run_dir / "config.yaml"
    run_config.write_text(config_path.read_text())
    forks = start_forks(cfg)
    if forks is not None:
        FORK_SERVERS.append(forks)
    return start_job(cfg, run_config, resume=False, forks=forks), cfg


def release_forks() -> None:
    """Close the fork servers ``launch`` started, reap what this process adopted meanwhile and stop being a child
    subreaper (roles still running stay its children)."""
    if not FORK_SERVERS:
        return
    while FORK_SERVERS:
        FORK_SERVERS.pop().close()
    reap_orphans(set())
    become_subreaper(on=False)


def wait_until(predicate, timeout_s: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s}s"
        time.sleep(0.3)


def wait_steps(cfg, count: int, timeout_s: float = 240, job: LocalJob | None = None) -> list[dict]:
    """Block until metrics.jsonl has ``count`` steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_metrics(cfg.run_dir / "metrics.jsonl")
        if len(records) >= count:
            return records
        if job is not None and job.children["trainer"].poll() not in (None, 0):
            raise AssertionError(tail(job, "trainer"))
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} steps after {timeout_s}s")


def wait_exit(job: LocalJob, role: str, timeout_s: float = 300) -> int:
    proc = job.children[role]
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    if proc.poll() is None:
        raise AssertionError(f"{role} still running after {timeout_s}s\n{tail(job, role)}")
    return proc.returncode


def tail(job: LocalJob, role: str, chars: int = 4000) -> str:
    path = job.logs / f"{role}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def signal_role(job: LocalJob, role: str, sig: signal.Signals) -> None:
    """SIGKILL takes the role's whole process tree (a dead trainer is torchrun and its ranks);
    other signals go to the role's process group, as a terminal or an orchestrator sends them."""
    if sig == signal.SIGKILL:
        kill_tree(job.children[role].pid)
    else:
        os.killpg(job.children[role].pid, sig)


def ledger_fates(cfg) -> dict[str, list[str]]:
    """prompt id -> its event states in order (rewound entries dropped)."""
    fates: dict[str, list[str]] = {}
    for line in (cfg.run_dir / "controller" / "ledger.jsonl").read_text().splitlines():
        event = json.loads(line)
        if "state" not in event:  # a note (how a group's episodes ended), not a state change
            continue
        if event["state"] == "rewound":
            fates.pop(event["id"], None)
        else:
            fates.setdefault(event["id"], []).append(event["state"])
    return fates


def assert_nothing_lost(job: LocalJob, cfg, *, finished: bool = True) -> None:
    """Every drawn prompt ended trained, filtered or failed; none trained twice. A run stopped before its
    last step (``finished=False``) may hold one produced, unreported batch: those prompts stay queued or
    pending, kept by the controller for the resumed trainer."""
    fates = ledger_fates(cfg)
    allowed = {"trained", "filtered", "failed"} | (set() if finished else {"pending", "queued"})
    unfinished = {pid: f for pid, f in fates.items() if f[-1] not in allowed}
    assert not unfinished, f"prompts without a final state: {list(unfinished.items())[:5]}"
    twice = [pid for pid, f in fates.items() if f.count("trained") > 1]
    assert not twice, f"trained twice: {twice[:5]}"
    if finished:
        assert controller_status(job.controller_address).ledger.pending == 0


def start_up(config_path: Path, *, resume: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``relayrl up CONFIG`` as a user starts it, in its own session (``env`` added to this process's environment);
    its stderr is kept for the assertion message."""
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(config_path), *(["--resume"] if resume else [])]
    env = {**os.environ, "COLUMNS": "400", **(env or {})}  # rich wraps its messages at the console width
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)


def up_to_the_end(
    config_path: Path, overrides: list[str], *, cwd: Path, run_dir: Path, timeout: float
) -> subprocess.CompletedProcess:
    """``relayrl up CONFIG --set ...`` run to its end as a user runs it; asserts exit 0, the message carrying its
    stderr and the tail of each of ``run_dir``'s role logs."""
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(config_path)]
    for override in overrides:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log")) if run_dir.exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs
    return done


@contextlib.contextmanager
def running_up(config_path: Path) -> Iterator[subprocess.Popen]:
    """``start_up``; whatever happens in the block, a ``relayrl up`` still running at its end is killed (its tree)."""
    up = start_up(config_path)
    try:
        yield up
    finally:
        if up.poll() is None:
            kill_tree(up.pid)


def contiguous_records(cfg, steps: int) -> list[dict]:
    """The run's metrics records, asserted to be steps 1..``steps``: none repeated, none skipped."""
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records


def supervised_roles(cfg) -> dict[str, dict]:
    """role -> {pid, restarts, exit_codes, log}: ``relayrl up``'s supervisor state file."""
    path = cfg.run_dir / "supervisor.json"
    return json.loads(path.read_text())["roles"] if path.exists() else {}


def gpu_host() -> bool:
    """A GPU driver is here: ``relayrl up`` starts no fork server, every role starts fresh (launcher.start_forks)."""
    return any(os.path.exists(node) for node in GPU_DRIVER_NODES)


def assert_roles_forked(cfg, launcher: int) -> None:
    """Every supervised role is a child of ``relayrl up`` (``launcher``), named by its own command line
    (``relayrl.cli <role> ...``), and forked by its fork server (the pid in its log), which a GPU host has not."""
    commands = {"controller": "controller serve", "rollout": "rollout serve", "trainer": "trainer"}
    server_log = cfg.run_dir / "logs" / "forkserver.log"
    forked = server_log.read_text() if server_log.exists() else ""
    on_gpu_host = gpu_host()
    for role, entry in supervised_roles(cfg).items():
        stat = Path(f"/proc/{entry['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert int(stat[1]) == launcher, (role, stat[1], launcher)
        assert f"-m relayrl.cli {commands[role.split('-')[0]]}" in cmdline, (role, cmdline)
        assert (f"forked pid {entry['pid']}: " in forked) != on_gpu_host, (role, entry["pid"], forked)


def rank_pid(trainer_pid: int, rank: int) -> int:
    """The pid of trainer rank ``rank`` below the trainer role's process: by its environment under torchrun, else
    (ranks forked by relayrl.trainer.launch.fork_ranks, whose environment is set after the fork, which /proc does
    not show) the ``rank``-th of the role's children in the order they started (forked in rank order)."""
    forked = []
    for pid in descendants(trainer_pid):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
                return pid
            if pid in child_pids(trainer_pid) and b"trainer run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                forked.append((process_start_ticks(pid), pid))
    if len(forked) > rank:
        return sorted(forked)[rank][1]
    raise AssertionError(f"no trainer rank {rank} below pid {trainer_pid}")


def trained_counts(cfg) -> Counter:
    """prompt id -> how many times the ledger says it was trained."""
    return Counter(pid for pid, fates in ledger_fates(cfg).items() for state in fates if state == "trained")


def finish(proc: subprocess.Popen, timeout_s: float = 600, tail: int = 3000) -> tuple[int, str]:
    """Wait for ``relayrl up`` (reading its stderr, so it never blocks on a full pipe); its code and stderr's last
    ``tail`` characters."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return proc.returncode, err.decode(errors="replace")[-tail:]
