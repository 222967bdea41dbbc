"""Start-up checks: what would make a role die while it starts, found before any role starts and before the
run directory is created (``relayrl up``, ``relayrl check``).

Each failure is a ConfigError whose one line starts with the key: the GPUs and CPUs the roles are placed on,
the model (a local Hugging Face directory with weights, whose tokenizer loads; a hub id ``org/name``; or a
``builtin:``), the dataset (a file or directory that exists, of a type relayrl reads; a JSONL file's every line a
JSON object, the prompt and answer columns in its first; or a hub dataset id), the reward function (importable
from PYTHONPATH or the working directory, as the roles import it, of a form relayrl calls), the eval sets (as
the dataset), the environment (``environment.serve`` importable, each of ``environment.servers`` listening), the
engine (installed, at a supported version), the controller's port (free, when fixed), the TLS files (readable
PEM), and last the two that import torch: every registry name in the config (advantage estimator, policy loss,
aggregation, KL estimator: the trainer's registries, whatever they hold), the model's tokenizer (it loads) and a
forced attention implementation (the model's architecture supports it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import socket
from pathlib import Path

import yaml

from relayrl.config import (
    BUILTIN_DATA,
    BUILTIN_MODELS,
    HUMANEVAL,
    REASONING_GYM,
    ConfigError,
    DataConfig,
    RelayConfig,
    dump_config,
    parse_config,
)
from relayrl.cores.threads import check_role_cpus
from relayrl.ops.placement import node_devices, place
from relayrl.runtime.attention import AUTO, load_with_attention
from relayrl.runtime.forkserver import ForkServer
from relayrl.runtime.ports import port_in_use

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
HUB_MODEL_ID = re.compile(rf"^{_NAME}/{_NAME}$")  # org/name
HUB_DATASET_ID = re.compile(rf"^({_NAME}/)?{_NAME}$")  # name or org/name
# what from_pretrained loads weights from (sharded files included); a config and tokenizer alone make transformers
# build a tokenizer, and the roles die loading the model
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


# How long `relayrl check` waits for the hub's answer on a hub model id (huggingface_hub's own default)
HUB_TIMEOUT_S = 10.0

# How long a listed environment server has to accept a TCP connection (it is up before the run starts).
CONNECT_TIMEOUT_S = 2.0


def preflight(cfg: RelayConfig, *, load_tokenizer: bool = True) -> None:
    """Every check of ``CHECKS``, in order (the machine's GPUs and CPUs first: they need nothing loaded), then
    ``HEAVY_CHECKS`` (they import torch and transformers); the first failure is raised. ``load_tokenizer=False``
    leaves the heavy ones to the caller (``heavy_checks``: ``relayrl up`` starts its fork server first, to run them
    there)."""
    for check in CHECKS:
        check(cfg)
    if load_tokenizer:
        heavy_checks(cfg)


def heavy_checks(cfg: RelayConfig, forks: ForkServer | None = None) -> None:
    """The checks that import torch (the trainer's registries) and transformers (the tokenizer). With ``forks``
    (``relayrl up``'s fork server) they run there (``heavy_checks_of``), where the roles' imports of torch and
    transformers are made anyway, so this process makes none: a refusal is raised here with the same line. A
    server that cannot answer, or an error that is not a refusal, has them run here instead, as without one."""
    if forks is not None:
        reply = forks.call(f"{__name__}:heavy_checks_of", dump_config(cfg))
        if reply.get("raised") == f"{ConfigError.__module__}.{ConfigError.__qualname__}":
            raise ConfigError(reply["message"])
        if reply.get("ok"):
            return
    for check in HEAVY_CHECKS:
        check(cfg)


def heavy_checks_of(config: str) -> None:
    """``heavy_checks`` of a config ``dump_config`` wrote (in the fork server)."""
    heavy_checks(parse_config(yaml.safe_load(config)))


def check_placement(cfg: RelayConfig) -> None:
    """The roles' GPUs fit this node (relayrl.ops.placement)."""
    place(cfg, node_devices(cfg.supervisor.gpus))


def check_cpus(cfg: RelayConfig) -> None:
    """The CPUs a role is pinned to are on this machine (relayrl.cores.threads)."""
    check_role_cpus(cfg)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_model(cfg: RelayConfig) -> None:
    model = cfg.model
    if model.path == "builtin:smollm2-135m-instruct":
        from relayrl.models.smollm2 import missing_extra

        if reason := missing_extra():
            raise ConfigError(f"model.path: {model.path} {reason}")
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
    else:
        check_hub_model(model.path)


def check_hub_model(model_id: str) -> None:
    """A hub id resolves as the roles resolve it: its config.json is in the local hub cache, or downloads (into that
    cache). Not so: the hub has no such model, the hub is offline (HF_HUB_OFFLINE), or it cannot be reached (one
    connection try, not huggingface_hub's retries over half a minute); each said in one line naming model.path,
    before anything is created."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return
    where = f"model.path: {model_id}: not in the local hub cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where}, and the hub is offline (HF_HUB_OFFLINE): name a local model directory")
    hub = urlsplit(constants.ENDPOINT)
    try:
        port = hub.port or (443 if hub.scheme == "https" else 80)
        socket.create_connection((hub.hostname, port), timeout=HUB_TIMEOUT_S).close()
        hf_hub_download(model_id, "config.json", etag_timeout=HUB_TIMEOUT_S)
    except (OSError, LocalEntryNotFoundError) as err:  # no name, no route, refused, timed out
        raise ConfigError(
            f"{where}, and the hub ({constants.ENDPOINT}) cannot be reached ({_first_line(err)}): this machine looks "
            "offline; download the model where the hub is reachable, or name a local model directory"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model.path: {model_id}: no such model on the hub ({constants.ENDPOINT}), or it is private or gated and "
            "this machine is not logged in (hf auth login)"
        ) from None
    except EntryNotFoundError:
        raise ConfigError(f"model.path: {model_id}: the hub's repository has no config.json (not a model)") from None


def check_tokenizer(cfg: RelayConfig) -> None:
    """A local model directory's tokenizer loads as the roles load it (``AutoTokenizer``)."""
    model = cfg.model
    path = Path(model.path)
    if model.path in BUILTIN_MODELS or not path.is_dir():
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise ConfigError(f"model.path: the tokenizer in {path} does not load: {_first_line(err)}") from None
    data = cfg.data
    if data.chat_template != "auto" or getattr(tokenizer, "chat_template", None):
        return
    if data.system_prompt is not None:
        from relayrl.data.prompts import NO_TEMPLATE_FOR_SYSTEM

        raise ConfigError(f"{NO_TEMPLATE_FOR_SYSTEM} ({path})")
    if data.path.startswith(REASONING_GYM) and (data.reasoning_gym is None or data.reasoning_gym.system_prompt):
        raise ConfigError(
            f"data.reasoning_gym.system_prompt: the library's system prompt is a system turn, and the tokenizer in "
            f"{path} has no chat template: set it to null and ask for the answer format in data.prompt_template"
        )


def check_attention(cfg: RelayConfig) -> None:
    """A forced ``model.attn_implementation`` is one a local model's architecture supports: the model built on the
    meta device (no weights, no memory) with it, as the roles load it. Whether this machine has the kernel's
    package (flash-attn) is left to the roles: the GPU nodes may have what this one lacks."""
    model = cfg.model
    path = Path(model.path)
    if model.attn_implementation == AUTO or model.path in BUILTIN_MODELS or not path.is_dir():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    try:
        with torch.device("meta"):
            load_with_attention(AutoModelForCausalLM.from_config, config, model.attn_implementation)
    except ValueError as err:
        if not isinstance(err.__cause__, ImportError):
            raise ConfigError(str(err)) from None


def check_routing_replay(cfg: RelayConfig) -> None:
    """``algorithm.routing_replay`` asks for a model with replayable mixture-of-experts routers
    (``relayrl.algorithms.routing_replay``): a local model is built on the meta device to find them; the built-in
    models are dense."""
    path = cfg.model.path
    if not cfg.algorithm.routing_replay:
        return
    if path in BUILTIN_MODELS:
        raise ConfigError(
            f"algorithm.routing_replay: model.path {path} is a dense model (no mixture-of-experts router)"
        )
    if not Path(path).is_dir():
        return  # a hub id: the roles find out once they have downloaded it
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.algorithms.routing_replay import unsupported_reason

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    if reason := unsupported_reason(model):
        raise ConfigError(f"algorithm.routing_replay: {reason} (model.path {path})")


def check_data(cfg: RelayConfig) -> None:
    """``data`` (as every eval set, ``check_data_section``); a reasoning-gym task's eval set of the same task and
    seed would be its training rows; ``controller.reward.fn: reasoning_gym`` scores reasoning-gym rows only."""
    check_data_section(cfg.data, "data")
    if cfg.data.path.startswith(REASONING_GYM) and cfg.eval is not None:
        from relayrl.data.gym_tasks import settings

        for name, data in cfg.eval.sets.items():
            if data.path == cfg.data.path and settings(data).seed == settings(cfg.data).seed:
                raise ConfigError(
                    f"eval.sets.{name}.reasoning_gym.seed: {settings(data).seed}, the training's seed for the same "
                    "task: its rows would be the training's; set another seed (rows the training has are left out)"
                )
    reward = cfg.controller.reward
    gym_sets = [cfg.data, *(cfg.eval.sets.values() if cfg.eval is not None else [])]
    if "reasoning_gym" in [reward.fn, *reward.fns] and not all(d.path.startswith(REASONING_GYM) for d in gym_sets):
        raise ConfigError(
            f"controller.reward.fn: reasoning_gym scores the rows of data.path {REASONING_GYM}<task> only (the "
            "task's score_answer reads the row's entry); every data set of this run must be one"
        )


def check_data_section(data: DataConfig, key: str) -> None:
    """``key``: the section's dotted path in the config (``data``, ``eval.sets.NAME``), named by each error."""
    if data.path.startswith(REASONING_GYM):
        from relayrl.data.gym_tasks import check

        try:
            check(data)
        except ValueError as err:
            raise ConfigError(f"{key}.{err}") from None
        return
    if data.path == HUMANEVAL:
        from relayrl.runtime.humaneval import missing_extra

        if reason := missing_extra():
            raise ConfigError(f"{key}.path: {HUMANEVAL} {reason}")
    if data.reasoning_gym is not None:
        raise ConfigError(f"{key}.reasoning_gym: set beside path {data.path}; it configures {REASONING_GYM}<task> only")
    if data.path in (*BUILTIN_DATA, HUMANEVAL):
        return
    from relayrl.data.formats import FILE_BUILDERS

    path = Path(data.path)
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ConfigError(f"{key}.path: unsupported file type {path.suffix!r} (use {sorted(FILE_BUILDERS)})")
        if path.suffix == ".jsonl":
            _check_rows(path, data, key)
    elif not path.is_dir() and (path.suffix in FILE_BUILDERS or not HUB_DATASET_ID.match(data.path)):
        raise ConfigError(f"{key}.path: {data.path}: no such file or directory, and not a hub dataset id or a builtin:")


def _check_rows(path: Path, data: DataConfig, section: str) -> None:
    """Every non-blank line is a JSON object (the loader fails on the first that is not, naming no line); the
    first holds the prompt and answer columns (and those ``prompt_template`` reads); every later row holds each of
    them too, not null (the loader would fill a missing one with null, which trains as the text "None")."""
    from relayrl.data.prompts import template_fields

    fields = template_fields(data.prompt_template) if data.prompt_template is not None else [data.prompt_key]
    needed = {name: "prompt_template" if data.prompt_template is not None else "prompt_key" for name in fields}
    needed[data.answer_key] = "answer_key"
    row, lacking = None, None
    with path.open(encoding="utf-8", errors="replace") as rows:
        for number, line in enumerate(rows, 1):
            if not line.strip():
                continue
            try:
                parsed = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{section}.path: {path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"{section}.path: {path}:{number}: not a JSON object (a {type(parsed).__name__})")
            row = parsed if row is None else row
            if lacking is None and (missing := [name for name in needed if parsed.get(name) is None]):
                lacking = (number, missing[0])
    if row is None:
        raise ConfigError(f"{section}.path: {path} has no rows")
    for key in ("prompt_key", "answer_key"):
        column = getattr(data, key)
        if column not in row:
            raise ConfigError(
                f"{section}.{key}: column {column!r} not in the first row of {path} (found: {sorted(row)})"
            )
    if data.prompt_template is not None:
        unknown = [name for name in fields if name not in row]
        if unknown:
            raise ConfigError(
                f"{section}.prompt_template: reads {unknown}, not in the first row of {path} (found: {sorted(row)})"
            )
    if lacking is not None:
        number, column = lacking
        raise ConfigError(
            f"{section}.{needed[column]}: {path}:{number}: the row has no {column!r} (missing or null; every row "
            "needs one)"
        )


def check_eval(cfg: RelayConfig) -> None:
    """``eval``: every set's data is there (as ``check_data``), maj@n has an answer to extract (an extractor named or
    the reward function's own; never for episodes, whose answer is the environment's), the best metric is one the
    eval reports."""
    if cfg.eval is None:
        return
    from relayrl.rewards.eval_metrics import ANSWER_EXTRACTORS, metric_names, reward_extractor
    from relayrl.rewards.weighted import reward_name

    ecfg = cfg.eval
    for name, data in ecfg.sets.items():
        check_data_section(data, f"eval.sets.{name}")
    if ecfg.answer_extractor is not None and ecfg.answer_extractor not in ANSWER_EXTRACTORS:
        known = ", ".join(ANSWER_EXTRACTORS.names())
        raise ConfigError(f"eval.answer_extractor: unknown extractor {ecfg.answer_extractor!r} (known: {known})")
    if "maj" in ecfg.metrics:
        reward = cfg.controller.reward
        if cfg.environment is not None:
            raise ConfigError("eval.metrics: maj@n votes on extracted answers; an episode's score is its environment's")
        if ecfg.answer_extractor is None and reward_extractor(reward) is None:
            scoring = f"controller.reward.fns {list(reward.fns)}" if reward.fns else f"reward {reward.fn!r}"
            raise ConfigError(
                f"eval.metrics: maj@n needs an answer to vote on, and {scoring} has no one extractor of its own: "
                f"set eval.answer_extractor ({', '.join(ANSWER_EXTRACTORS.names())})"
            )
    if ecfg.best is not None:
        functions = [reward_name(spec) for spec in cfg.controller.reward.fns]
        known = [f"{s}/{m}" for s in ecfg.sets for m in metric_names(ecfg.metrics, ecfg.n, ecfg.k, functions)]
        if ecfg.best.metric not in known:
            raise ConfigError(f"eval.best.metric: {ecfg.best.metric!r} is not reported (reported: {', '.join(known)})")


def check_reward(cfg: RelayConfig) -> None:
    """``controller.reward``: the function resolves and has a form (relayrl.rewards.check_reward, the controller's
    own check at its start)."""
    from relayrl.rewards import check_reward as controller_check
    from relayrl.rewards.weighted import weighted_rewards

    try:
        controller_check(cfg.controller.reward)
        weighted_rewards(cfg.controller.reward)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    from relayrl.runtime.reasoning_gym import missing_extra

    for name, module, dist in (
        ("math_verify", "math_verify", "math-verify"),
        ("reasoning_gym", "reasoning_gym", "reasoning-gym"),
    ):
        if name in [cfg.controller.reward.fn, *cfg.controller.reward.fns] and (reason := missing_extra(module, dist)):
            raise ConfigError(f"controller.reward.fn: {name} {reason}")


def check_environment(cfg: RelayConfig) -> None:
    """``environment.serve`` imports as its servers import it; every ``environment.servers`` address accepts a
    connection (a server started elsewhere is up before the run starts)."""
    env = cfg.environment
    if env is None:
        return
    if env.serve:
        from relayrl.env.server import load_environment

        try:
            load_environment(env.serve)
        except ConfigError as err:
            raise ConfigError(f"environment.serve: {err}") from None
    for i, address in enumerate(env.servers):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as err:
            why = err.strerror or type(err).__name__
            raise ConfigError(f"environment.servers: [{i}] {address}: no server listens there ({why})") from None


# config key -> (module, registry attribute): every name the trainer looks up in a registry at its start
REGISTRY_KEYS = {
    "algorithm.advantage": ("relayrl.algorithms.advantages", "ADVANTAGE_ESTIMATORS"),
    "algorithm.distill_task_advantage": ("relayrl.algorithms.advantages", "ADVANTAGE_ESTIMATORS"),  # null: none
    "algorithm.policy_loss": ("relayrl.algorithms.policy_loss", "POLICY_LOSSES"),
    "algorithm.loss_agg": ("relayrl.algorithms.aggregation", "LOSS_AGGREGATIONS"),
    "algorithm.kl_estimator": ("relayrl.algorithms.kl", "KL_ESTIMATORS"),
}


def check_registry_names(cfg: RelayConfig) -> None:
    """Each key of ``REGISTRY_KEYS`` that is set names an entry of its registry (as registered when the check runs: a
    new estimator needs no change here). ConfigError naming the key and the known names."""
    for key, (module, attr) in REGISTRY_KEYS.items():
        section, field = key.split(".")
        name = getattr(getattr(cfg, section), field)
        registry = getattr(importlib.import_module(module), attr)
        if name is not None and name not in registry:
            raise ConfigError(f"{key}: unknown {registry.kind} {name!r}; known: {', '.join(registry.names())}")


def check_engine(cfg: RelayConfig) -> None:
    """vllm/sglang, of the rollout workers and of each judge ``relayrl up`` starts: installed (distribution metadata,
    else an importable module: a source tree or a test's stand-in, whose ``__version__`` the engine checks at start)
    at a version in SUPPORTED_VERSIONS. ConfigError naming the key."""
    started = {f"scorers.{name}.engine": s.engine for name, s in cfg.scorers.items() if s.replicas}
    for key, engine in {"rollout.engine": cfg.rollout.engine, **started}.items():
        if engine != "hf":
            check_installed(key, engine)


def check_installed(key: str, engine: str) -> None:
    """The engine ``key`` names is installed at a supported version (``check_engine``)."""
    from relayrl.rollout.external import SUPPORTED_VERSIONS, install_hint, version_supported

    try:
        found = importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec(engine) is None:
            raise ConfigError(f"{key}: {engine} is not installed: {install_hint(engine)}") from None
        return
    if not version_supported(engine, found):
        wanted = f"{engine}{SUPPORTED_VERSIONS[engine]}"
        raise ConfigError(f"{key}: {engine} {found} is installed, relayrl supports {wanted}: {install_hint(engine)}")


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


# what `relayrl up` and `relayrl check` run before anything starts, in order (cheap first), then the heavy ones
CHECKS = (
    check_placement,
    check_cpus,
    check_model,
    check_data,
    check_reward,
    check_eval,
    check_environment,
    check_engine,
    check_port,
    check_tls,
)
HEAVY_CHECKS = (check_registry_names, check_tokenizer, check_attention, check_routing_replay)
