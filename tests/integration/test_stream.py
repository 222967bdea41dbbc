"""On-policy streaming through ``relayrl up`` (max_staleness 0, trainer.stream auto): groups reach the trainer
while the batch generates, and a controller killed mid-stream costs no step twice (issue #9 item 4)."""

from __future__ import annotations

import json
import time

import pytest

from relayrl.config import load_config
from relayrl.runtime.procs import kill_tree
from relayrl.trainer.metrics import read_metrics

from .jobs import contiguous_records, finish, ledger_fates, running_up, supervised_roles, trained_counts, wait_steps

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_up_streams_on_policy_and_survives_a_controller_killed_mid_stream(make_config):
    """8 steps of the demo's shape at K = 0; the controller is SIGKILLed while step 4 or later streams (one prompt per
    Generate call, so its groups arrive one by one; the moment is a race, the log says whether parts had
    arrived) and restarted by the supervisor: the trainer voids the parts it had (weights and optimizer back to
    the step's start) and trains the restarted controller's batch. Steps are contiguous, every one exactly
    on-policy, the ledger exact; no trainer restart was needed. The streaming trainer yielded at nice 19."""
    steps, groups = 8, 4
    config = make_config(
        "stream",
        trainer={"steps": steps, "stream": "auto", "nproc": 2},  # rank 0 broadcasts the stream's parts
        controller={"max_staleness": 0, "dispatch_chunk": 1, "worker_max_calls": 1},
        supervisor={"backoff_s": 0.5},
    )
    cfg = load_config(config)
    assert cfg.streams
    with running_up(config) as up:
        wait_steps(cfg, 3, timeout_s=600)
        time.sleep(0.3)  # step 4's first groups reach the trainer (on a fast machine a later step's)
        killed_in = len(read_metrics(cfg.run_dir / "metrics.jsonl")) + 1  # the step in progress
        kill_tree(supervised_roles(cfg)["controller"]["pid"])
        code, err = finish(up)
    assert code == 0, err
    records = contiguous_records(cfg, steps)
    assert all(r["rollout_version_min"] == r["rollout_version_max"] == r["step"] - 1 for r in records)
    # a step's batch may be complete before the trainer asks for it, and is then sent whole: step 1 (it starts with
    # the trainer's first publish), the steps built while the restarted controller re-learns the verified workers,
    # and, on a machine whose other load starves the nice-19 trainer, any step; so most, not all, steps stream
    streamed = [r["step"] for r in records if r["streamed"] == 1.0]
    around_restart = {killed_in, killed_in + 1}
    assert len(set(range(2, steps + 1)) - around_restart - set(streamed)) <= 2, (streamed, killed_in)
    assert all(r["old_logprobs_from_engine"] == 1.0 for r in records if r["streamed"])
    assert all(r["logprob_mismatch_max"] < 1e-3 for r in records)
    restarts = {role: entry["restarts"] for role, entry in supervised_roles(cfg).items()}
    assert restarts["controller"] == 1 and restarts["trainer"] == 0, restarts
    trained = trained_counts(cfg)
    assert sum(trained.values()) == len(trained) == steps * groups  # exactly, none twice
    fates = ledger_fates(cfg)
    assert not [pid for pid, f in fates.items() if f[-1] not in {"trained", "filtered", "failed"}]
    trainer_log = (cfg.run_dir / "logs" / "trainer.log").read_text()
    yielded = [line for line in trainer_log.splitlines() if "beside the rollout workers: this trainer" in line]
    assert yielded and all("nice 19" in line for line in yielded), yielded  # relayrl/cores/threads.py
    broke = f"the batch stream of step {killed_in} broke" in trainer_log
    print(json.dumps({"killed_in_step": killed_in, "stream_broke_mid_step": broke, "streamed_steps": streamed}))
