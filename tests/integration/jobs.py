"""Helpers for tests that run a real local job (controller, workers, trainer) and break it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from relayrl.config import load_config
from relayrl.launcher import LocalJob, controller_status, start_job
from relayrl.procs import kill_tree
from relayrl.trainer.metrics import read_metrics


def launch(config_path: Path) -> tuple[LocalJob, object]:
    cfg = load_config(config_path)
    (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    run_config = cfg.run_dir / "config.yaml"
    run_config.write_text(config_path.read_text())
    return start_job(cfg, run_config, resume=False), cfg


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
