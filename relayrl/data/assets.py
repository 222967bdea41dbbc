"""Demo assets a config can ask for: the tiny Qwen2 model and the digits dataset, built locally.

Every role calls ``prepare_assets`` before loading anything, so a job started by Slurm or Kubernetes
(where no launcher runs first) builds them too. Building is atomic (a temp path renamed into
place), so roles racing on a shared filesystem end with one complete copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from relayrl.config import RelayConfig


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:  # another role got there first: theirs is identical (same seed)
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def prepare_assets(cfg: RelayConfig) -> list[str]:
    """Build what the config marks as build-if-missing; returns what this call built."""
    built = []
    model_dir = Path(cfg.model.path)
    if cfg.model.build_tiny_if_missing and not (model_dir / "config.json").exists():
        from relayrl.models.tiny import write_tiny_model

        model_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
        write_tiny_model(tmp, seed=cfg.run.seed, hidden_size=cfg.model.tiny_hidden_size, layers=cfg.model.tiny_layers)
        _publish(tmp, model_dir)
        built.append(cfg.model.path)
    if cfg.data.generate_digits_if_missing and not Path(cfg.data.path).exists():
        from relayrl.data.digits import write_digits_jsonl

        write_digits_jsonl(cfg.data.path, seed=cfg.run.seed)  # writes a temp file, then renames
        built.append(cfg.data.path)
    return built
