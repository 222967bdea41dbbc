"""Operator output: rich tables for people, JSON (the proto3 JSON mapping, field names as in the .proto)
for scripts. Nothing here ever prints a credential: the responses carry none."""

from __future__ import annotations

import json
import time

from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from relayrl.config import CORRECTION_PREFIX
from relayrl.ops.run_record import correction_rows
from relayrl.v1 import controller_pb2


def to_dict(message: Message) -> dict:
    return json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )


def print_json(console: Console, message: Message | dict) -> None:
    payload = message if isinstance(message, dict) else to_dict(message)
    console.print_json(json.dumps(payload))


def _ago(unix: float) -> str:
    return f"{time.time() - unix:.0f}s ago" if unix > 0 else "never"


def duration(seconds: float) -> str:
    """``1h 02m``, ``3m 05s``, ``42s``."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def pace_rows(status: controller_pb2.StatusResponse) -> list[tuple[str, str]]:
    """Step/total, recent reward, samples/s and ETA (StatusResponse's pace fields)."""
    total = status.total_steps
    step = f"{status.trainer_step}/{total}" + (f" ({100 * status.trainer_step / total:.0f}%)" if total else "")
    over = f" (last {status.recent_steps} steps)" if status.recent_steps else ""
    reward = f"{status.recent_reward:.3f}{over}" if status.HasField("recent_reward") else "- (no step yet)"
    rate = f"{status.samples_per_second:.1f}{over}" if status.recent_steps else "-"
    eta = duration(status.eta_seconds) if status.HasField("eta_seconds") else "unknown (no step reported yet)"
    return [("trainer step", step), ("recent reward", reward), ("samples/s", rate), ("ETA", eta)]


def eval_rows(status: controller_pb2.StatusResponse) -> list[tuple[str, str]]:
    """One row per held-out set: its latest eval's version and metrics (none without an eval section)."""
    return [
        (
            f"eval {e.name}",
            f"version {e.policy_version}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(e.metrics.items()) if "@" in k or "^" in k),
        )
        for e in status.evals
    ]


def status_tables(status: controller_pb2.StatusResponse) -> list[Table]:
    run = Table(title=f"run '{status.run_name}'", show_header=False)
    run.add_column("key", style="bold")
    run.add_column("value")
    desired = str(status.desired_rollout_replicas) if status.desired_rollout_replicas else "unset"
    drained = ", ".join(status.drained_workers)
    for key, value in (
        ("state", status.state + (f" ({status.error})" if status.error else "")),
        *pace_rows(status),
        *eval_rows(status),
        ("policy version", str(status.policy_version)),
        ("rollout workers", f"{len(status.workers)} registered, desired {desired}"),
        ("drained", f"{drained} (stopped; not restarted under relayrl up)" if drained else "none"),
        ("dataset cursor", str(status.dataset_cursor)),
        ("last sync", f"{status.last_sync_seconds:.2f}s, {_ago(status.last_sync_unix)}"),
        ("restarts", ", ".join(f"{role} {n}" for role, n in sorted(status.restarts.items()) if n) or "none"),
    ):
        run.add_row(key, value)
    workers = Table(title="rollout workers")
    for column in ("worker", "address", "engine", "state", "version", "in flight", "tokens/s"):
        workers.add_column(column, justify="right" if column in ("version", "in flight", "tokens/s") else "left")
    for w in status.workers:
        numbers = (str(w.policy_version), str(w.in_flight), f"{w.tokens_per_second:.0f}")
        workers.add_row(w.worker_id, w.address, w.engine, w.state, *numbers)
    ledger = Table(title="prompt ledger")
    for column in ("drawn", "trained", "filtered", "failed", "pending", "torn tails cut"):
        ledger.add_column(column, justify="right")
    c = status.ledger
    ledger.add_row(*(str(v) for v in (c.dispatched, c.trained, c.filtered, c.failed, c.pending, c.torn_tails)))
    tables = [run, workers, ledger, *([scorers_table(status.scorers)] if status.scorers else [])]
    if c.failed_by_reason:
        tables.append(failed_table(dict(c.failed_by_reason)))
    if rows := correction_rows(dict(status.step_metrics)):
        tables.append(correction_table(rows, status.trainer_step))
    return tables


def scorers_table(scorers) -> Table:
    """Every scorer server of the run's served rewards (``StatusResponse.scorers``)."""
    table = Table(title="scorers")
    for column in ("scorer", "address", "kind", "items", "batch size", "latency", "queued"):
        table.add_column(column, justify="left" if column in ("scorer", "address", "kind") else "right")
    for s in scorers:
        if s.error:
            table.add_row(s.name, s.address, f"unreachable: {s.error}", "", "", "", "")
            continue
        numbers = (str(s.items_scored), f"{s.mean_batch_size:.1f}", f"{s.mean_latency_s * 1000:.0f} ms", str(s.queued))
        table.add_row(s.name, s.address, s.kind, *numbers)
    return table


def correction_table(rows: list[tuple[str, float]], step: int) -> Table:
    """The trainer's rollout-correction diagnostics of ``step`` (docs/algorithms.md, "Rollout correction")."""
    table = Table(title=f"rollout correction at step {step} ({CORRECTION_PREFIX}*, at the step's start)")
    table.add_column("diagnostic")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, f"{value:.4g}")
    return table


def failed_table(by_reason: dict[str, int]) -> Table:
    """Failed prompts by the kind of their reason (``LedgerCounts.failed_by_reason``), the most first."""
    table = Table(title="failed prompts by reason")
    table.add_column("reason")
    table.add_column("prompts", justify="right")
    for reason, count in sorted(by_reason.items(), key=lambda item: -item[1]):
        table.add_row(reason, str(count))
    return table


def weights_tables(weights: controller_pb2.WeightsStatusResponse) -> list[Table]:
    workers = Table(title=f"worker weights (controller at version {weights.policy_version})")
    for column in ("worker", "state", "version", "last load", "sync group", "tokens generated", "error"):
        workers.add_column(column)
    for w in weights.workers:
        workers.add_row(
            w.worker_id,
            w.state,
            "torn" if w.policy_version < 0 else str(w.policy_version),
            f"{w.last_update_seconds:.3f}s",
            w.weight_sync_group or "-",
            str(w.generated_tokens),
            w.error,
        )
    syncs = Table(title="recent weight syncs (newest last)")
    for column in ("version", "reason", "seconds", "workers", "left out", "when"):
        syncs.add_column(column)
    for s in weights.recent_syncs:
        left_out = ", ".join(f"{k}: {v}" for k, v in sorted(s.failed.items())) or "-"
        workers_synced = str(len(s.synced_worker_ids))
        syncs.add_row(str(s.policy_version), s.reason, f"{s.seconds:.3f}", workers_synced, left_out, _ago(s.unix_time))
    pending = weights.sync_request_pending
    syncs.caption = f"operator requests: handled up to #{weights.sync_request_handled}" + (
        f", #{pending} pending" if pending else ""
    )
    return [workers, syncs]
