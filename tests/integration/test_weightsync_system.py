"""Weight sync in the running system: joiners, a receiver dying mid-broadcast, versions never torn."""

from __future__ import annotations

import signal

import pytest

from relayrl.launcher import controller_status
from relayrl.rpc.channels import open_channel
from relayrl.runtime import faults
from relayrl.trainer.metrics import read_metrics
from relayrl.v1 import rollout_pb2, rollout_pb2_grpc

from .jobs import launch, signal_role, tail, wait_exit, wait_steps, wait_until

pytestmark = pytest.mark.slow


def spawn_worker(job, name: str, env: dict[str, str] | None = None):
    argv = list(job.children["rollout-0"].args)
    argv[argv.index("--worker-id") + 1] = name
    return job.spawn(name, argv, env=env)


def loaded_checksums(address: str) -> dict[int, str]:
    stub = rollout_pb2_grpc.RolloutServiceStub(open_channel(address))
    return {v.policy_version: v.checksum for v in stub.Stats(rollout_pb2.StatsRequest(), timeout=10).loaded}


def test_joining_worker_serves_the_current_version_from_its_first_trajectory(make_config):
    job, cfg = launch(make_config("join", rollout={"workers": 1}, trainer={"steps": 500}))
    try:
        joined_after = wait_steps(cfg, 3, job=job)[-1]["step"]
        spawn_worker(job, "rollout-1")
        wait_until(lambda: "rollout-1" in {w.worker_id for w in controller_status(job.controller_address).workers})
        metrics = cfg.run_dir / "metrics.jsonl"
        wait_until(lambda: sum("rollout-1" in r["rollout_workers"] for r in read_metrics(metrics)) >= 5)
        signal_role(job, "trainer", signal.SIGTERM)
        assert wait_exit(job, "trainer") == 0, tail(job, "trainer")
        records = read_metrics(metrics)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        for r in records:  # every trajectory, the joiner's first included, came from the current policy
            assert r["rollout_version_min"] == r["step"] - 1
        trainer = {r["policy_version"]: r["weights_checksum"] for r in records}
        workers = {w.worker_id: w.address for w in controller_status(job.controller_address).workers}
        joiner = loaded_checksums(workers["rollout-1"])
        assert min(joiner) >= joined_after  # it never held an older version it could have served
        assert all(trainer[v] == c for v, c in joiner.items())
        for r in records:  # what it generated with, it had loaded completely: the trainer's exact bytes
            if "rollout-1" in r["rollout_workers"]:
                assert joiner[r["step"] - 1] == trainer[r["step"] - 1]
    finally:
        job.stop()


def test_worker_dying_mid_broadcast_is_dropped_and_the_step_completes(make_config, monkeypatch):
    steps, die_at, timeout_s = 10, 5, 10
    monkeypatch.setenv(faults.ARM, f"rollout.load@rollout-1/{die_at}")  # rollout-1 dies mid-load of version 5
    job, cfg = launch(
        make_config(
            "die",
            trainer={"steps": steps},
            controller={"dispatch_chunk": 1},
            weight_sync={"bucket_mib": 0.0625, "timeout_s": timeout_s},  # ~5 buckets for the tiny model
        )
    )
    try:
        assert wait_exit(job, "trainer") == 0, tail(job, "trainer")
        assert job.children["rollout-1"].poll() == 137, tail(job, "rollout-1")  # it died mid-load
        records = {r["step"]: r for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
        assert sorted(records) == list(range(1, steps + 1))
        assert records[die_at - 1]["workers_synced"] == 2
        assert records[die_at]["workers_synced"] == 1
        # it was dropped for its death (gloo's closed connection or gRPC's), not waited for to the group's timeout
        trainer_log = tail(job, "trainer", 200_000)
        (left_out,) = [line for line in trainer_log.splitlines() if f"v{die_at}: worker rollout-1 left out" in line]
        assert not any(word in left_out.lower() for word in ("timed out", "timeout", "deadline")), (
            left_out + "\n" + tail(job, "rollout-0")
        )
        for r in records.values():
            assert r["rollout_version_min"] == r["step"] - 1
            if r["step"] > die_at:
                assert r["rollout_workers"] == ["rollout-0"]
    finally:
        job.stop()
