"""``relayrl bench rollout-correction`` reads both runs back: each run's reward and held-out accuracy, its
rollout_corr/* diagnostics averaged over the first and the last 10 steps (eval lines apart), every step's, and a
plot of the two runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.bench.example_run import ExampleRun
from relayrl.bench.rollout_correction import plot, summarize


def fake_run(tmp_path: Path, name: str, kl: float) -> ExampleRun:
    """A run directory whose metrics.jsonl has 20 steps (kl_k3 ``kl`` x step) and evals at 0 and 20."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    lines = [{"eval": "heldout", "step": 0, "mean@1": 0.4}]
    for step in range(1, 21):
        lines.append({
            "step": step, "reward_mean": 0.2 if step <= 10 else 0.7, "stale_token_share": 1.0,
            "mixed_version_samples": 16, "logprob_mismatch": 0.1, "rollout_corr/kl_k3": kl * step,
            "rollout_corr/rejected_token_share": 0.05, "loss": 1.0,
        })  # fmt: skip
    lines.append({"eval": "heldout", "step": 20, "mean@1": 0.9})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    machine = {"resolved": {"trainer": {"precision": "bfloat16"}}, "loadavg_at_end": [1.0, 1.0, 1.0]}
    return ExampleRun(run_dir, tmp_path, 60.0, machine)


def test_each_run_is_summarized_with_its_diagnostics_drift_and_both_are_plotted(tmp_path) -> None:
    runs = {
        "uncorrected": summarize(fake_run(tmp_path, "off", 0.01)),
        "corrected": summarize(fake_run(tmp_path, "on", 0.0)),
    }
    off = runs["uncorrected"]
    assert (
        off["steps"] == 20
        and off["reward_first10"] == pytest.approx(0.2)
        and off["reward_last10"] == pytest.approx(0.7)
    )
    assert (off["heldout_before"]["accuracy"], off["heldout_after"]["accuracy"]) == (0.4, 0.9)
    # the mean of steps 1-10 and of 11-20; keys other than the diagnostics (loss) are left out
    assert off["diagnostics_first10"] == {
        "logprob_mismatch": pytest.approx(0.1), "rollout_corr/kl_k3": pytest.approx(0.055),
        "rollout_corr/rejected_token_share": pytest.approx(0.05),
    }  # fmt: skip
    assert off["diagnostics_last10"]["rollout_corr/kl_k3"] == pytest.approx(0.155)
    assert off["per_step"][0] == {
        "step": 1, "reward_mean": 0.2, "stale_token_share": 1.0, "mixed_version_samples": 16,
        "logprob_mismatch": 0.1, "rollout_corr/kl_k3": 0.01, "rollout_corr/rejected_token_share": 0.05,
    }  # fmt: skip
    assert off["resolved"]["trainer"]["precision"] == "bfloat16"
    png = plot({"runs": runs}, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
