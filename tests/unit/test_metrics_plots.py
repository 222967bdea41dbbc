"""metrics.png (relayrl/trainer/metrics.py): the training metrics per step, the KLs each titled by its key."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.trainer.metrics import plot_training, training_panels

PNG = b"\x89PNG\r\n\x1a\n"


def test_metrics_png_plots_each_recorded_training_metric(tmp_path: Path) -> None:
    records = [
        {"step": s, "loss": 0.1 * s, "kl": -0.01, "ref_kl": 0.0, "ppo_kl": -0.01, "entropy": 1.0,
         "response_len_mean": 5.0, "clip_frac": 0.1, "lr": 1e-6}
        for s in range(1, 5)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert out == tmp_path / "metrics.png" and out.read_bytes().startswith(PNG)
    assert [key for key, _ in training_panels(records)] == [
        "loss", "ref_kl", "ppo_kl", "entropy", "response_len_mean", "clip_frac", "lr",
    ]  # fmt: skip
    assert [key for key, _ in training_panels([{"step": 1, "ppo_kl": 0.1}])] == ["ppo_kl"]  # a run that logged no lr


def test_each_kl_panel_is_titled_by_what_it_plots_and_ref_kl_needs_a_reference() -> None:
    """With kl_coef 0 the run's `kl` is ppo_kl (it can go negative): no panel calls it the KL to the reference."""
    record = {"step": 1, "kl": -0.01, "ref_kl": 0.0, "ppo_kl": -0.01}
    assert training_panels([record], reference=False) == [("ppo_kl", "ppo_kl: KL(old ‖ new) of the update")]
    with_reference = dict(training_panels([record], reference=True))
    assert with_reference["ref_kl"].startswith("ref_kl: KL to the reference")
    assert all(key in title for key, title in training_panels([record]) if "KL" in title)


def test_no_metrics_no_png(tmp_path: Path) -> None:
    assert plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png") is None
    assert not (tmp_path / "metrics.png").exists()
