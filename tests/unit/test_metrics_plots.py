"""metrics.png (relayrl/trainer/metrics.py): loss, KL, entropy, response length, clip fraction and lr per step."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.trainer.metrics import plot_training, training_panels

PNG = b"\x89PNG\r\n\x1a\n"


def test_metrics_png_plots_each_recorded_training_metric(tmp_path: Path) -> None:
    records = [
        {"step": s, "loss": 0.1 * s, "kl": 0.0, "entropy": 1.0, "response_len_mean": 5.0, "clip_frac": 0.1, "lr": 1e-6}
        for s in range(1, 5)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert out == tmp_path / "metrics.png" and out.read_bytes().startswith(PNG)
    assert [key for key, _ in training_panels(records)] == [
        "loss", "kl", "entropy", "response_len_mean", "clip_frac", "lr",
    ]  # fmt: skip
    assert [key for key, _ in training_panels([{"step": 1, "kl": 0.1}])] == ["kl"]  # a run that logged no lr


def test_no_metrics_no_png(tmp_path: Path) -> None:
    assert plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png") is None
    assert not (tmp_path / "metrics.png").exists()
