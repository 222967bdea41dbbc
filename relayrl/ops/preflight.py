"""Start-up checks: what would make a role die while it starts, found before any role starts and before the
run directory is created (``relayrl up``, ``relayrl check``).

Each failure is a ConfigError whose one line starts with the key: the GPUs and CPUs the roles are placed on,
the model (a local Hugging Face directory with weights, whose tokenizer loads; a hub id ``org/name``; or a
``builtin:``), the dataset (a file or directory that exists, of a type relayrl reads, with the prompt and answer
columns in its first JSON row; or a hub dataset id), the reward function (importable, of a form relayrl calls),
the engine (installed, at a supported version), the controller's port (free, when fixed), the TLS files
(readable PEM), and last the model's tokenizer (it loads: the one check that imports transformers and torch).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

from relayrl.config import (
    BUILTIN_DATA,
    BUILTIN_MODELS,
    ConfigError,
    DataConfig,
    ModelConfig,
    RelayConfig,
    RewardConfig,
)
from relayrl.ops.placement import node_devices, place
from relayrl.runtime.ports import port_in_use
from relayrl.runtime.threads import check_role_cpus

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
HUB_MODEL_ID = re.compile(rf"^{_NAME}/{_NAME}$")  # org/name
HUB_DATASET_ID = re.compile(rf"^({_NAME}/)?{_NAME}$")  # name or org/name
# what from_pretrained loads weights from (sharded files included); a config and tokenizer alone make transformers
# build a tokenizer, and the roles die loading the model
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def preflight(cfg: RelayConfig, *, load_tokenizer: bool = True) -> None:
    """Every check below, in order (the machine's GPUs and CPUs first: they need nothing loaded; the tokenizer
    last: loading it imports transformers and torch); the first failure is raised. ``load_tokenizer=False``
    leaves that last one to the caller (``relayrl up`` starts its fork server first, to import beside it)."""
    place(cfg, node_devices(cfg.supervisor.gpus))  # GPU over-subscription
    check_role_cpus(cfg)  # CPUs a role is pinned to that are not here
    check_model(cfg.model)
    check_data(cfg.data)
    check_reward(cfg.controller.reward)
    check_eval(cfg)
    check_engine(cfg.rollout.engine)
    check_port(cfg)
    check_tls(cfg)
    if load_tokenizer:
        check_tokenizer(cfg.model)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_model(model: ModelConfig) -> None:
    if model.path in BUILTIN_MODELS:
        return
    path = Path(model.path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} has no config.json (not a Hugging Face model directory)")
        if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
            raise ConfigError(f"model.path: {path} has no weights (no {' or '.join(WEIGHT_FILES)})")
    elif path.exists():
        raise ConfigError(f"model.path: {path} is a file, not a model directory")
    elif not HUB_MODEL_ID.match(model.path):
        raise ConfigError(f"model.path: {model.path}: no such directory, and not a hub id (org/name) or a builtin:")


def check_tokenizer(model: ModelConfig) -> None:
    """A local model directory's tokenizer loads as the roles load it (``AutoTokenizer``)."""
    path = Path(model.path)
    if model.path in BUILTIN_MODELS or not path.is_dir():
        return
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise ConfigError(f"model.path: the tokenizer in {path} does not load: {_first_line(err)}") from None


def check_data(data: DataConfig, key: str = "data") -> None:
    """``key``: the section's dotted path in the config (``data``, ``eval.sets.NAME``), named by each error."""
    if data.path in BUILTIN_DATA:
        return
    from relayrl.data.formats import FILE_BUILDERS

    path = Path(data.path)
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ConfigError(f"{key}.path: unsupported file type {path.suffix!r} (use {sorted(FILE_BUILDERS)})")
        if path.suffix == ".jsonl":
            _check_first_row(path, data, key)
    elif not path.is_dir() and (path.suffix in FILE_BUILDERS or not HUB_DATASET_ID.match(data.path)):
        raise ConfigError(f"{key}.path: {data.path}: no such file or directory, and not a hub dataset id or a builtin:")


def _check_first_row(path: Path, data: DataConfig, section: str) -> None:
    with path.open() as rows:
        line = next((line for line in rows if line.strip()), None)
    if line is None:
        raise ConfigError(f"{section}.path: {path} has no rows")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{section}.path: {path}: the first row is not JSON ({err.msg})") from None
    for key in ("prompt_key", "answer_key"):
        column = getattr(data, key)
        if not isinstance(row, dict) or column not in row:
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"{section}.{key}: column {column!r} not in the first row of {path} (found: {found})")


def check_eval(cfg: RelayConfig) -> None:
    """``eval``: every set's data is there (as ``check_data``), maj@n has an answer to extract (an extractor named or
    the reward function's own; never for episodes, whose answer is the environment's), the best metric is one the
    eval reports."""
    if cfg.eval is None:
        return
    from relayrl.rewards.eval_metrics import ANSWER_EXTRACTORS, DEFAULT_EXTRACTOR, metric_names

    ecfg = cfg.eval
    for name, data in ecfg.sets.items():
        check_data(data, f"eval.sets.{name}")
    if ecfg.answer_extractor is not None and ecfg.answer_extractor not in ANSWER_EXTRACTORS:
        known = ", ".join(ANSWER_EXTRACTORS.names())
        raise ConfigError(f"eval.answer_extractor: unknown extractor {ecfg.answer_extractor!r} (known: {known})")
    if "maj" in ecfg.metrics:
        fn = cfg.controller.reward.fn
        if cfg.environment is not None:
            raise ConfigError("eval.metrics: maj@n votes on extracted answers; an episode's score is its environment's")
        if ecfg.answer_extractor is None and fn not in DEFAULT_EXTRACTOR:
            raise ConfigError(
                f"eval.metrics: maj@n needs an answer to vote on, and reward {fn!r} has no extractor of its own: set "
                f"eval.answer_extractor ({', '.join(ANSWER_EXTRACTORS.names())})"
            )
    if ecfg.best is not None:
        known = [f"{s}/{m}" for s in ecfg.sets for m in metric_names(ecfg.metrics, ecfg.n, ecfg.k)]
        if ecfg.best.metric not in known:
            raise ConfigError(f"eval.best.metric: {ecfg.best.metric!r} is not reported (reported: {', '.join(known)})")


def check_reward(cfg: RewardConfig) -> None:
    """``controller.reward``: the function resolves and has a form (relayrl.rewards.check_reward, the controller's
    own check at its start)."""
    from relayrl.rewards import check_reward as controller_check

    try:
        controller_check(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_engine(engine: str) -> None:
    """vllm/sglang: installed (distribution metadata, else an importable module: a source tree or a test's stand-in,
    whose ``__version__`` the engine checks at start) at a version in SUPPORTED_VERSIONS."""
    if engine == "hf":
        return
    from relayrl.rollout.external import SUPPORTED_VERSIONS, install_hint, version_supported

    try:
        found = importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec(engine) is None:
            raise ConfigError(f"rollout.engine: {engine} is not installed: {install_hint(engine)}") from None
        return
    if not version_supported(engine, found):
        wanted = f"{engine}{SUPPORTED_VERSIONS[engine]}"
        raise ConfigError(
            f"rollout.engine: {engine} {found} is installed, relayrl supports {wanted}: {install_hint(engine)}"
        )


def check_port(cfg: RelayConfig) -> None:
    """The controller's fixed port is free (``controller.port: 0`` picks a free one)."""
    host, port = cfg.controller.host, cfg.controller.port
    if port and (why := port_in_use(host, port)):
        raise ConfigError(f"controller.port: {host}:{port} is in use ({why})")


def check_tls(cfg: RelayConfig) -> None:
    for key in ("tls_cert", "tls_key", "tls_ca"):
        path = getattr(cfg.security, key)
        if path is None:
            continue
        try:
            text = Path(path).read_bytes()
        except OSError as err:
            raise ConfigError(f"security.{key}: {path}: cannot read ({err.strerror})") from None
        if b"-----BEGIN " not in text:
            raise ConfigError(f"security.{key}: {path} is not PEM (no -----BEGIN line)")
