"""What a run directory says of a run whose controller is gone (``relayrl status --run runs/NAME``): how it ended
(finished, failed and why, stopped by a signal), from the ``summary.json`` ``relayrl up`` writes at every end, or
stopped (died or killed, no summary), from the last record of its ``metrics.jsonl``; each with when."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Literal

from relayrl.config import CORRECTION_PREFIX, correction_metrics_of
from relayrl.runtime.address import parse_address
from relayrl.trainer.metrics import read_metrics

CONNECT_TIMEOUT_S = 1.0
RunEnd = Literal["finished", "failed", "stopped"]  # how `relayrl up` ended a run (summary.json's "ended")


def listening(address: str) -> bool:
    """Whether anything accepts a connection at ``host:port`` now (a gone controller: refused at once)."""
    parsed = parse_address(address, "controller.address")
    try:
        socket.create_connection((parsed.host.strip("[]"), parsed.port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def ended_record(run_dir: Path) -> dict | None:
    """The run's final state when ``relayrl up`` ended it since its last start (``summary.json`` newer than the
    ``controller.address`` each start writes): state finished, failed or stopped (``ended``; a summary without one
    is a finished run's), with its ``reason`` and the last step's rollout-correction diagnostics (``step_metrics``);
    else None."""
    summary, address = run_dir / "summary.json", run_dir / "controller.address"
    if not summary.is_file() or (address.is_file() and address.stat().st_mtime > summary.stat().st_mtime):
        return None
    record = json.loads(summary.read_text())
    last = last_step_record(run_dir)
    return {
        "state": record.get("ended", "finished"),
        "at": _when(summary.stat().st_mtime),
        **record,
        "step_metrics": correction_metrics_of(last) if last else {},
    }


def last_step_record(run_dir: Path) -> dict | None:
    """The last trained step's record in the run's ``metrics.jsonl`` (eval lines and lines torn by a kill skipped),
    None when there is none."""
    records = read_metrics(run_dir / "metrics.jsonl")
    return records[-1] if records else None


def stopped_record(run_dir: Path, total_steps: int | None = None) -> dict:
    """The state of a run that did not finish and has no controller: its last trained step, when, and that step's
    rollout-correction diagnostics (``step_metrics``)."""
    last = last_step_record(run_dir)
    record = {"state": "stopped", "run_dir": str(run_dir), "steps": last["step"] if last else 0}
    if last is not None:
        record["at"] = _when((run_dir / "metrics.jsonl").stat().st_mtime)
        if "reward_mean" in last:
            record["reward_last"] = last["reward_mean"]
        record["step_metrics"] = correction_metrics_of(last)
    if total_steps is not None:
        record["total_steps"] = total_steps
    return record


def describe(record: dict) -> str:
    """One line for the console, and a second with the last step's rollout-correction diagnostics when it has any."""
    metrics = record.get("step_metrics")
    if not metrics:
        return _headline(record)
    shown = ", ".join(f"{name} {value:.4g}" for name, value in correction_rows(metrics))
    return f"{_headline(record)}\nrollout correction at step {record['steps']} ({CORRECTION_PREFIX}*): {shown}"


def correction_rows(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """The ``rollout_corr/*`` diagnostics among ``metrics`` as (name without the prefix, value), by name."""
    return sorted((k.removeprefix(CORRECTION_PREFIX), v) for k, v in metrics.items() if k.startswith(CORRECTION_PREFIX))


def _headline(record: dict) -> str:
    if record["state"] == "finished":
        reward = ""
        if "reward_window" in record:
            window = record["reward_window"]
            reward = f", reward {record['reward_start']:.3f} -> {record['reward_end']:.3f} (first/last {window} steps)"
        return (
            f"run {record['run_dir']}: finished at {record['at']} after {record['steps']} steps in "
            f"{record['wall_seconds']:.0f} s{reward}; its controller is gone"
        )
    of = f" of {record['total_steps']}" if "total_steps" in record else ""
    if "ended" in record:  # failed or stopped, said by its summary
        return (
            f"run {record['run_dir']}: {record['state']} at {record['at']} after {record['steps']}{of} steps trained: "
            f"{record.get('reason', 'no reason recorded')}"
        )
    when = f", the last at {record['at']}" if "at" in record else ""
    return (
        f"run {record['run_dir']}: not running (no controller answers) and not finished: {record['steps']}{of} "
        f"steps trained{when}; `relayrl up --resume` continues it"
    )
