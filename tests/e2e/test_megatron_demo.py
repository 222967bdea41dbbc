"""The demo on the Megatron-core backend, as a user runs it: `relayrl up examples/digits.yaml --set
trainer.backend=megatron --set trainer.megatron.tensor_parallel=2 --set trainer.nproc=2`, killed (SIGKILL, every
process) after its first checkpoint and continued with `--resume`: the curve continues from the checkpoint
and the policy learns as the FSDP demo does; the weights the workers last received are the exported `final/`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.config import load_config
from relayrl.runtime.procs import kill_tree
from relayrl.trainer.metrics import read_evals, read_metrics
from relayrl.trainer.precision import Precision
from relayrl.weightsync.checksum import weights_checksum

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = 50
STEPS = 100  # half the demo's 200: the bars below are the FSDP demo's at step 100
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # two `relayrl up` runs, 2 trainer ranks each


def mean_reward(records: list[dict]) -> float:
    return sum(r["reward_mean"] for r in records) / len(records)


def test_megatron_tp2_demo_learns_and_resumes_after_a_kill(tmp_path):
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(ROOT / "examples/digits.yaml")]
    for override in (
        f"run.dir={tmp_path / 'runs'}",
        "trainer.backend=megatron",
        "trainer.megatron.tensor_parallel=2",
        "trainer.nproc=2",
        f"trainer.steps={STEPS}",
        "weight_sync.verify=fingerprint",  # the full one: compared below with a checksum of the exported weights alone
        f"trainer.checkpoint_every={CHECKPOINT}",
    ):
        argv += ["--set", override]
    run_dir = tmp_path / "runs" / "digits"
    metrics = run_dir / "metrics.jsonl"
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        # the checkpoint is written before the next step starts: a record of step CHECKPOINT + 1 means it is complete
        while len(read_metrics(metrics)) < CHECKPOINT + 1:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint + 1 step within 900 s"
            time.sleep(0.2)
    finally:
        kill_tree(first.pid)  # the launcher, the controller, the workers, torchrun and its ranks
        first.wait()
    before = read_metrics(metrics)
    assert (run_dir / "checkpoints" / f"step_{CHECKPOINT}" / "trainer_state.json").exists()

    done = subprocess.run([*argv, "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[:CHECKPOINT] == before[:CHECKPOINT]  # the steps up to the checkpoint are kept as they were
    resumed = records[CHECKPOINT]
    assert resumed["data_cursor_start"] == before[CHECKPOINT - 1]["data_cursor_end"]  # the data continues
    # the policy continues: right after the resume it scores like the killed run did there, far above random
    assert mean_reward(records[CHECKPOINT : CHECKPOINT + 5]) >= 0.2 > mean_reward(records[:10])
    # learns as the FSDP demo does by step 100: there, in 8 FSDP runs and one Megatron run, the sampled reward's
    # last-10 mean was 0.56 to 0.79 and the greedy held-out accuracy 0.8 to 1.0, from 0.06 and 0.0 (the sampling
    # order of concurrent workers is not reproducible, so one run's curve varies)
    assert mean_reward(records[-10:]) >= 0.4
    heldout = {r["step"]: r["mean@1"] for r in read_evals(metrics) if r["eval"] == "heldout"}
    assert heldout[0] == 0.0 and heldout[STEPS] >= 0.7, heldout
    assert all(r["workers_synced"] == 2 for r in records[CHECKPOINT:])
    # the export holds the float32 master weights; the last sync sent them cast once to the engine's dtype
    cfg = load_config(run_dir / "config.yaml")
    engine = Precision.resolve(cfg.trainer, cfg.rollout.weight_dtype, torch.device("cpu")).engine
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    sent = ((name, p.detach().to(engine)) for name, p in final.named_parameters())
    assert weights_checksum(sent) == records[-1]["weights_checksum"]
