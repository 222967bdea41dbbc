"""Demo assets a config can ask for: the tiny Qwen2 model and the digits dataset, built locally."""

from __future__ import annotations

from pathlib import Path

from relayrl.config import RelayConfig


def prepare_assets(cfg: RelayConfig) -> list[str]:
    """Build what the config marks as build-if-missing; returns what was built."""
    built = []
    if cfg.model.build_tiny_if_missing and not (Path(cfg.model.path) / "config.json").exists():
        from relayrl.models.tiny import write_tiny_model

        write_tiny_model(
            cfg.model.path, seed=cfg.run.seed, hidden_size=cfg.model.tiny_hidden_size, layers=cfg.model.tiny_layers
        )
        built.append(cfg.model.path)
    if cfg.data.generate_digits_if_missing and not Path(cfg.data.path).exists():
        from relayrl.data.digits import write_digits_jsonl

        write_digits_jsonl(cfg.data.path, seed=cfg.run.seed)
        built.append(cfg.data.path)
    return built
