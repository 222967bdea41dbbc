"""The demo's built-in assets, named by ``builtin:`` paths: ``model.path: builtin:tiny-qwen2`` (a seeded tiny
Qwen2 sized by ``model.tiny_hidden_size``/``tiny_layers``), ``builtin:tiny-chat`` (the agentic demo's tiny chat
model, relayrl/models/tiny_chat.py) and ``data.path: builtin:digits`` (the digits task).

Nothing is ever built because a path is missing: only these names build anything, into
``<run dir>/assets/`` (``asset_dir``). Every role calls ``prepare_assets`` before loading anything, so a job
started by Slurm or Kubernetes (where no launcher runs first) builds them too. Building is atomic (a temp path
renamed into place), so roles racing on a shared filesystem end with one complete copy; a copy already there
is used as is (same seed, same bytes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from relayrl.config import BUILTIN, BUILTIN_DATA, BUILTIN_MODELS, RelayConfig

TINY_CHAT = "builtin:tiny-chat"


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``. A failed rename is a lost race only when ``final`` is there (another role got
    there first: theirs is identical, same seed), and ``tmp`` is then deleted; otherwise the error is raised."""
    try:
        os.rename(tmp, final)
    except OSError as err:
        if not final.exists():
            raise OSError(f"cannot build {final}: renaming {tmp} failed: {err}") from err
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def asset_dir(cfg: RelayConfig) -> Path:
    """Where the run's built-in assets live: ``<run dir>/assets``."""
    return cfg.run_dir / "assets"


def builtin_model_path(cfg: RelayConfig) -> Path:
    """The directory a ``builtin:`` model stands for; its name holds every input of the build (builtin:tiny-chat's
    size is fixed: relayrl/models/tiny_chat.py)."""
    m = cfg.model
    name = m.path.removeprefix(BUILTIN)
    if m.path == TINY_CHAT:
        return asset_dir(cfg) / f"{name}-seed{cfg.run.seed}"
    return asset_dir(cfg) / f"{name}-h{m.tiny_hidden_size}-l{m.tiny_layers}-seed{cfg.run.seed}"


def builtin_data_path(cfg: RelayConfig) -> Path:
    """The file ``builtin:digits`` stands for."""
    return asset_dir(cfg) / f"{cfg.data.path.removeprefix(BUILTIN)}-seed{cfg.run.seed}.jsonl"


def prepare_assets(cfg: RelayConfig) -> list[str]:
    """Build the ``builtin:`` assets ``cfg`` names (when not built yet) and point ``cfg.model.path`` /
    ``cfg.data.path`` at them, in place; returns the paths this call built."""
    built = []
    if cfg.model.path in BUILTIN_MODELS:
        model_dir = builtin_model_path(cfg)
        if not (model_dir / "config.json").exists():
            model_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
            m = cfg.model
            if m.path == TINY_CHAT:
                from relayrl.models.tiny_chat import write_tiny_chat_model

                write_tiny_chat_model(tmp, seed=cfg.run.seed)
            else:
                from relayrl.models.tiny import write_tiny_model

                write_tiny_model(tmp, seed=cfg.run.seed, hidden_size=m.tiny_hidden_size, layers=m.tiny_layers)
            _publish(tmp, model_dir)
            built.append(str(model_dir))
        cfg.model.path = str(model_dir)
    if cfg.data.path in BUILTIN_DATA:
        data_file = builtin_data_path(cfg)
        if not data_file.exists():
            from relayrl.data.digits import write_digits_jsonl

            write_digits_jsonl(data_file, seed=cfg.run.seed)  # writes a temp file, then renames
            built.append(str(data_file))
        cfg.data.path = str(data_file)
    return built
