"""`relayrl up examples/digits.yaml` on tiny models of families other than Llama, as issue 44's table measured them
(model.path a saved family model with the digits example's tokenizer, float32, a few steps): the hf engine starts
on each and its logprobs are the trainer's at every step (logprob_mismatch, |trainer - engine| per token: float
rounding, ~1e-7, where a wrong mask, window or head scaling gives 0.03-0.2). Gemma2: eager attention (its default;
the engine asked for SDPA and did not start), logit soft-capping and a 6-token sliding window every other layer, far
shorter than a group's shared-prompt layout; Granite: logits_scaling and its embedding, residual and attention
multipliers."""

from __future__ import annotations

from pathlib import Path

import pytest
from integration.jobs import up_to_the_end

from relayrl.models.families import write_family_model
from relayrl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("family", "attention"), [("gemma2", "eager"), ("granite", "sdpa")])
def test_the_engine_logprobs_are_the_trainers_at_every_step(family, attention, tmp_path) -> None:
    model = write_family_model(family, tmp_path / family)
    overrides = [
        f"run.dir={tmp_path / 'runs'}",
        f"model.path={model}",
        f"trainer.steps={STEPS}",
        "trainer.precision=float32",
        "controller.dynamic_sampling=false",  # a random model's groups mostly score alike: no step waits on them
        "trainer.skip_zero_advantage=false",  # and they are trained all the same: each group's prompt is shared
        "eval=null",
    ]
    run_dir = tmp_path / "runs" / "digits"
    up_to_the_end(ROOT / "examples/digits.yaml", overrides, cwd=tmp_path, run_dir=run_dir, timeout=600)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == STEPS
    mismatches = [r["logprob_mismatch"] for r in records]
    assert all(m < 1e-4 for m in mismatches), mismatches  # measured: gemma2 ~5e-8, granite ~2e-9
    assert all(r["prefix_shared"] > 0 for r in records)  # the trainer shared each group's prompt (its default)
    engine_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert f"hf engine: {attention} attention (model.attn_implementation=auto)" in engine_log
