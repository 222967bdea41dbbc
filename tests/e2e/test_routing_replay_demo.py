"""`relayrl up examples/digits.yaml` on a tiny mixture-of-experts model whose routing flips between precisions
(``families.write_near_tied_moe``: router rows that differ far below a bf16 ulp, experts scaled up), with the hf
engine in bf16 and the trainer in float32: with ``algorithm.routing_replay`` the engine's routed experts travel with
each sample through the controller to the trainer, whose forward replays them, and its logprobs are the engine's
within bf16 rounding (logprob_mismatch ~5e-4); without it the trainer routes most tokens to other experts and misses
them by ~0.05 a token. One step: the first update already pulls the routers' rows apart (no more ties)."""

from __future__ import annotations

from pathlib import Path

import pytest
from integration.jobs import up_to_the_end

from relayrl.models.families import write_near_tied_moe
from relayrl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("replay", [True, False])
def test_with_routing_replay_the_trainer_logprobs_are_the_bf16_engines(replay, tmp_path) -> None:
    model = write_near_tied_moe(tmp_path / "moe")
    overrides = [
        f"run.dir={tmp_path / 'runs'}",
        f"model.path={model}",
        "trainer.steps=1",
        "trainer.precision=float32",
        "rollout.weight_dtype=bfloat16",
        "rollout.max_tokens=8",
        "rollout.workers=1",
        "controller.dynamic_sampling=false",
        "trainer.skip_zero_advantage=false",  # the mismatch measured on every row, whatever the rewards
        "eval=null",
        f"algorithm.routing_replay={str(replay).lower()}",
    ]
    run_dir = tmp_path / "runs" / "digits"
    up_to_the_end(ROOT / "examples/digits.yaml", overrides, cwd=tmp_path, run_dir=run_dir, timeout=600)
    (record,) = read_metrics(run_dir / "metrics.jsonl")
    if replay:
        assert record["logprob_mismatch"] < 0.005, record  # measured ~5e-4: bf16 rounding
        assert "recording routed experts" in (run_dir / "logs" / "rollout-0.log").read_text()
        trainer_log = "".join(p.read_text() for p in (run_dir / "logs").glob("trainer*.log"))
        assert "routing_replay: the policy's forwards go padded" in trainer_log
    else:
        assert record["logprob_mismatch"] > 0.02, record  # measured ~0.046
