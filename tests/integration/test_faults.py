"""Fault injection with real processes: dead, frozen and restarted roles, and graceful SIGTERM."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.launcher import controller_status
from relayrl.rpc.channels import open_channel
from relayrl.runtime.procs import descendants, kill_tree
from relayrl.trainer.metrics import read_metrics
from relayrl.trainer.schedule import lr_at
from relayrl.v1 import rollout_pb2, rollout_pb2_grpc

from .jobs import (
    assert_nothing_lost,
    finish,
    launch,
    ledger_fates,
    signal_role,
    start_up,
    tail,
    trained_counts,
    wait_exit,
    wait_steps,
    wait_until,
)

pytestmark = pytest.mark.slow

FAST_FAILURE = {"worker_timeout_s": 3, "generate_timeout_s": 20}


def contiguous(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:  # synchronous loop: every trained trajectory came from the previous version
        assert r["rollout_version_min"] == r["step"] - 1, r


def test_rollout_worker_sigkill_mid_step_then_controller_killed_and_restarted(make_config):
    """One job for two faults: rollout-1 SIGKILLed mid-step 3 (the step completes on the other worker, every later
    sync reaches the one left), then the controller SIGKILLed after step 5 and started again (the trainer and the
    worker reconnect to it); all 10 steps are trained once each, in order, each on the previous step's weights,
    and no prompt is lost."""
    steps = 10
    job, cfg = launch(make_config("kill", trainer={"steps": steps}, controller=FAST_FAILURE))
    try:
        wait_steps(cfg, 2, job=job)
        signal_role(job, "rollout-1", signal.SIGKILL)
        wait_steps(cfg, 5, job=job)
        argv = list(job.children["controller"].args)
        signal_role(job, "controller", signal.SIGKILL)
        job.children["controller"].wait()
        time.sleep(1)
        job.spawn("controller", argv)
        assert wait_exit(job, "trainer") == 0, tail(job, "trainer")
        records = read_metrics(cfg.run_dir / "metrics.jsonl")
        contiguous(records, steps)
        assert records[-1]["workers_synced"] == 1
        status = controller_status(job.controller_address)
        assert status.trainer_step == steps and [w.worker_id for w in status.workers] == ["rollout-0"]
        assert_nothing_lost(job, cfg)
    finally:
        job.stop()


def test_rollout_worker_frozen_then_back_and_sigterm_stops_each_role_cleanly(make_config):
    """A worker frozen (SIGSTOP) is declared dead while steps go on without it; back (SIGCONT), it registers again
    and is synced to the current version. Then SIGTERM stops each role cleanly, one at a time: the trainer
    checkpoints its last step and exits 0, a worker exits 0 and leaves the controller's list, the other worker and
    the controller exit 0."""
    job, cfg = launch(
        make_config("freeze", trainer={"steps": 1000}, controller=FAST_FAILURE, weight_sync={"timeout_s": 3})
    )
    metrics = cfg.run_dir / "metrics.jsonl"
    try:
        wait_steps(cfg, 2, job=job)
        signal_role(job, "rollout-1", signal.SIGSTOP)
        frozen_at = wait_steps(cfg, 3, job=job)[-1]["step"]  # steps go on without it
        wait_until(
            lambda: "rollout-1" not in {w.worker_id for w in controller_status(job.controller_address).workers},
            timeout_s=60,
            what="the frozen worker declared dead",
        )
        signal_role(job, "rollout-1", signal.SIGCONT)
        back = len(read_metrics(metrics))
        # it re-registers and is re-synced: both workers load the weights of later steps again
        wait_until(lambda: any(r["workers_synced"] == 2 for r in read_metrics(metrics)[back:]), what="re-sync")
        signal_role(job, "trainer", signal.SIGTERM)
        assert wait_exit(job, "trainer") == 0, tail(job, "trainer")
        records = read_metrics(metrics)
        contiguous(records, len(records))
        worker = next(w for w in controller_status(job.controller_address).workers if w.worker_id == "rollout-1")
        stats = rollout_pb2_grpc.RolloutServiceStub(open_channel(worker.address)).Stats(
            rollout_pb2.StatsRequest(), timeout=10
        )
        assert stats.policy_version == len(records) > frozen_at  # current again
        assert_nothing_lost(job, cfg, finished=False)
        assert (cfg.run_dir / "checkpoints" / f"step_{len(records)}" / "trainer_state.json").exists()
        signal_role(job, "rollout-0", signal.SIGTERM)
        assert wait_exit(job, "rollout-0", 60) == 0, tail(job, "rollout-0")
        assert [w.worker_id for w in controller_status(job.controller_address).workers] == ["rollout-1"]
        for role in ("rollout-1", "controller"):
            signal_role(job, role, signal.SIGTERM)
            assert wait_exit(job, role, 60) == 0, tail(job, role)
    finally:
        job.stop()


def test_trainer_killed_then_resumed(make_config):
    steps = 14
    schedule = {"lr_schedule": "cosine", "warmup_steps": 3}  # a resume continues it from the checkpoint's step
    job, cfg = launch(make_config("resume", trainer={"steps": steps, "checkpoint_every": 4, **schedule}))
    try:
        wait_steps(cfg, 5, job=job)
        signal_role(job, "trainer", signal.SIGKILL)
        job.children["trainer"].wait()
        before = read_metrics(cfg.run_dir / "metrics.jsonl")
        # the newest complete checkpoint: the kill may land while a newer one is being written (no trainer_state.json)
        complete = [
            int(p.parent.name.split("_")[1]) for p in (cfg.run_dir / "checkpoints").glob("step_*/trainer_state.json")
        ]
        job.respawn("trainer")  # as the supervisor restarts it: its command, environment and --resume
        assert wait_exit(job, "trainer") == 0, tail(job, "trainer")
        resumed_from = int(re.findall(r"resumed from \S*step_(\d+) at step", tail(job, "trainer", 200_000))[-1])
        assert resumed_from == max(complete), (resumed_from, complete)
        after = read_metrics(cfg.run_dir / "metrics.jsonl")
        contiguous(after, steps)  # no step repeated or skipped
        assert [r["lr"] for r in after] == pytest.approx(
            [lr_at(s, cfg.trainer) for s in range(1, steps + 1)], rel=1e-12
        )
        by_step = {r["step"]: r for r in before}
        # the resumed run continues from the checkpoint's data position...
        assert after[resumed_from]["data_cursor_start"] == by_step[resumed_from]["data_cursor_end"]
        if resumed_from + 1 in by_step:
            assert after[resumed_from]["data_cursor_start"] == by_step[resumed_from + 1]["data_cursor_start"]
        # ...and from the checkpoint's weights: what the workers reloaded hashes to that step's weights
        worker = controller_status(job.controller_address).workers[0]
        loaded = (
            rollout_pb2_grpc.RolloutServiceStub(open_channel(worker.address))
            .Stats(rollout_pb2.StatsRequest(), timeout=10)
            .loaded
        )
        reloads = [v for v in loaded if v.policy_version == resumed_from]
        assert reloads and all(v.checksum == by_step[resumed_from]["weights_checksum"] for v in reloads)
        assert_nothing_lost(job, cfg)
    finally:
        job.stop()


def test_sigterm_to_relayrl_up_shuts_the_job_down_and_resume_finishes_the_ledger(make_config):
    """SIGTERM stops every process; prompts drawn for the batch after the last trained step stay ``pending`` or
    ``queued``, and ``relayrl up --resume`` rewinds them to the checkpoint's cursor and trains them."""
    steps, groups = 10, 4  # enough that the SIGTERM after step 2 lands before the last step
    config = make_config("upterm", trainer={"steps": steps, "nproc": 2}, controller={"train_batch_groups": groups})
    proc = start_up(config)
    cfg = load_config(config)
    try:
        wait_steps(cfg, 2)
        tree = descendants(proc.pid)
        assert len(tree) >= 5  # controller, 2 workers, the trainer supervisor, its ranks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, proc.stderr.read().decode()[-2000:]
        deadline = time.monotonic() + 1  # a stopped role's own children may take a moment to go
        while (alive := _alive(tree)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"left running: {alive}"
        done = len(read_metrics(cfg.run_dir / "metrics.jsonl"))
        assert (cfg.run_dir / "checkpoints" / f"step_{done}").exists()  # the trainer checkpointed on its way out
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert done < steps
    code, err = finish(start_up(config, resume=True))
    assert code == 0, err
    assert [r["step"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    fates = ledger_fates(cfg)
    assert all(f[-1] in {"trained", "filtered", "failed"} for f in fates.values()), fates
    assert sorted(trained_counts(cfg).values()) == [1] * steps * groups


def test_sigkill_of_relayrl_up_stops_every_child(make_config):
    """The launcher killed outright (no handler runs): each child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and
    stops as on a SIGTERM to it, the trainer too, although its controller stops at the same moment (its retries give
    up). Nothing is left running."""
    config = make_config("upkill", trainer={"steps": 50, "nproc": 2})  # the supervisor passes it on to its ranks
    proc = start_up(config)
    cfg = load_config(config)
    tree: list[int] = []
    try:
        wait_steps(cfg, 1)
        tree = descendants(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 90
        while alive := _alive(tree):
            assert time.monotonic() < deadline, f"running 90 s after the launcher's SIGKILL: {_described(alive, cfg)}"
            time.sleep(0.5)
        logs = cfg.run_dir / "logs"
        assert "SIGTERM" in (logs / "trainer.log").read_text() and "SIGTERM" in (logs / "controller.log").read_text()
    finally:
        for pid in tree:
            kill_tree(pid)


def _described(pids: list[int], cfg) -> str:
    """Each pid's command line, then the tail of every role log (what the survivors were doing)."""
    lines = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            lines.append(f"{pid}: {argv[:200]}")
        except OSError:
            lines.append(f"{pid}: gone")
    for log in sorted((cfg.run_dir / "logs").glob("*.log")):
        lines.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(lines)


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (neither gone nor a zombie)."""
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
