"""The whole system as separate processes: controller + 2 rollout workers + a 2-rank FSDP2 trainer (and a
Megatron-core trainer with 2 pipeline stages: workers cannot tell which backend trained their weights).

After every weight sync each worker's loaded weights hash to the trainer's checksum for that
version, and the engine's logprobs equal the trainer's recomputed logprobs within 1e-3 (fp32).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relayrl.launcher import controller_status
from relayrl.rpc.channels import open_channel
from relayrl.trainer.metrics import REQUIRED_KEYS, read_metrics
from relayrl.v1 import rollout_pb2, rollout_pb2_grpc
from relayrl.weightsync.checksum import weights_checksum

from .jobs import launch, tail, wait_exit

pytestmark = pytest.mark.slow


TWO_RANKS = {"nproc": 2}  # FSDP shards gathered for the update
MEGATRON_PP2 = {"backend": "megatron", "megatron": {"pipeline_parallel": 2}, "nproc": 2}


@pytest.mark.parametrize(
    ("transport", "trainer"),
    [("broadcast", TWO_RANKS), ("filesystem", {}), ("broadcast", MEGATRON_PP2)],
    ids=["broadcast", "filesystem", "megatron-pp2"],
)
def test_three_steps_with_verified_weights_and_logprobs(make_config, transport, trainer):
    # the full fingerprint: the trainer's per-version checksum is then a value anyone can take of the weights
    # (the exported model's below); the default, sampled, also depends on the manifest's layout and phase
    weight_sync = {"transport": transport, "verify": "fingerprint"}
    job, cfg = launch(make_config("e2e", trainer={"steps": 3, **trainer}, weight_sync=weight_sync))
    try:
        assert wait_exit(job, "trainer", 300) == 0, tail(job, "trainer")

        records = read_metrics(cfg.run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3]
        for r in records:
            assert set(REQUIRED_KEYS) <= set(r)
            assert r["policy_version"] == r["step"]
            assert r["rollout_version_min"] == r["step"] - 1  # synchronous: step s trains version s-1 data
            assert r["workers_synced"] == 2
            assert r["logprob_mismatch_max"] < 1e-3  # engine vs trainer, same tokens, fp32

        status = controller_status(job.controller_address)
        assert {w.policy_version for w in status.workers} == {3}
        trainer_checksums = {r["policy_version"]: r["weights_checksum"] for r in records}
        for worker in status.workers:
            stub = rollout_pb2_grpc.RolloutServiceStub(open_channel(worker.address))
            stats = stub.Stats(rollout_pb2.StatsRequest(with_checksum=True), timeout=30)
            # version 0: the starting weights, published (and verified) before step 1 when the worker was up
            loaded = {v.policy_version: v.checksum for v in stats.loaded if v.policy_version > 0}
            assert loaded == trainer_checksums, f"{worker.worker_id} loaded other weights than the trainer sent"
            assert stats.weights_checksum == trainer_checksums[3]

        final = cfg.run_dir / "final"
        model = AutoModelForCausalLM.from_pretrained(final)
        assert weights_checksum(model.named_parameters()) == trainer_checksums[3]
        assert load_file(final / "model.safetensors")
        assert (cfg.run_dir / "checkpoints" / "step_3" / "trainer_state.json").exists()
        counts = status.ledger
        assert counts.pending == 0 and counts.trained > 0
    finally:
        job.stop()
