"""model.attn_implementation (relayrl/runtime/attention.py): the hf engine and the trainer's FSDP models load the
model with the same attention implementation: by default the model's own (Gemma2's is eager: the engine refused to
start on it when it asked for SDPA), or the one the key forces; a model that refuses it, and the undocumented engine
option that preceded the key, are refused naming the key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from trainer_testing import one_rank_world  # noqa: F401 (an autouse fixture)

from relayrl.config import ConfigError, ModelConfig, TrainerConfig, load_config
from relayrl.models.families import write_family_model
from relayrl.rollout.hf import HFEngine
from relayrl.runtime.attention import resolved
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.precision import FLOAT32_SDPA

TCFG = TrainerConfig(precision="float32")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: write_family_model(f, tmp_path_factory.mktemp(f)) for f in ("gemma2", "qwen2")}


def trainer_attention(path: Path, attn_implementation: str = "auto") -> str:
    backend = FSDPBackend(
        ModelConfig(path=str(path), attn_implementation=attn_implementation), TCFG, with_reference=True
    )
    assert resolved(backend.reference) == resolved(backend.model)
    return resolved(backend.model)


@pytest.mark.parametrize(("family", "default"), [("gemma2", "eager"), ("qwen2", "sdpa")])
def test_auto_loads_the_models_own_default_on_both_sides(family_dirs, family, default, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="relayrl.rollout.hf"):
        engine = HFEngine(str(family_dirs[family]))
    engine.close()
    assert resolved(engine.model) == trainer_attention(family_dirs[family]) == default
    assert f"hf engine: {default} attention (model.attn_implementation=auto)" in caplog.text


def test_a_forced_implementation_reaches_both_sides(family_dirs) -> None:
    engine = HFEngine(str(family_dirs["qwen2"]), attn_implementation="eager")
    engine.close()
    assert resolved(engine.model) == trainer_attention(family_dirs["qwen2"], "eager") == "eager"


def test_an_implementation_the_model_refuses_stops_both_sides_naming_the_key(family_dirs) -> None:
    refusal = (  # transformers' first sentence; its advice on calling from_pretrained is left out
        r"^model\.attn_implementation=sdpa: Gemma2ForCausalLM does not support an attention implementation through "
        r"torch\.nn\.functional\.scaled_dot_product_attention yet$"
    )
    with pytest.raises(ValueError, match=refusal):
        HFEngine(str(family_dirs["gemma2"]), attn_implementation="sdpa")
    with pytest.raises(ValueError, match=refusal):
        trainer_attention(family_dirs["gemma2"], "sdpa")


def test_the_engine_option_is_refused_for_the_documented_key(make_config) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.engine_options\.attn_implementation: set model\.attn_impl"):
        load_config(make_config(), ["rollout.engine_options.attn_implementation=eager"])
    assert load_config(make_config(), ["model.attn_implementation=eager"]).model.attn_implementation == "eager"


@pytest.mark.parametrize(
    ("engine", "option", "source"),
    [("hf", "dtype", "rollout.weight_dtype"), ("hf", "threads", "rollout.threads"), ("vllm", "seed", "run.seed")],
)
def test_an_engine_option_relayrl_passes_itself_is_refused_naming_its_key(make_config, engine, option, source) -> None:
    """Given twice, the adapter would die of a TypeError at start; refused at load instead, naming where it is set."""
    with pytest.raises(ConfigError, match=rf"rollout\.engine_options\.{option} \(from {source}\): set by relayrl"):
        load_config(make_config(), [f"rollout.engine={engine}", f"rollout.engine_options.{option}=1"])


def test_every_hf_option_a_rollout_worker_passes_is_refused_in_engine_options(make_config) -> None:
    """The refusal's table (config.ROLLOUT_ENGINE_ARGUMENTS) covers what serve_rollout gives the hf engine itself
    (rollout_server.hf_engine_options), attn_implementation refused with its own line above."""
    from relayrl.config import ROLLOUT_ENGINE_ARGUMENTS
    from relayrl.services.rollout_server import hf_engine_options

    passed = set(hf_engine_options(load_config(make_config()), threads=1)) - {"attn_implementation"}
    assert passed == set(ROLLOUT_ENGINE_ARGUMENTS["hf"])


@pytest.mark.parametrize(("family", "trained"), [("gemma2", "eager"), ("qwen2", FLOAT32_SDPA)])
def test_bf16_compute_on_a_cpu_keeps_an_eager_models_attention(family_dirs, family, trained) -> None:
    """Under bf16 compute on a CPU the trainer runs an SDPA model's attention in float32 (precision.FLOAT32_SDPA);
    Gemma2's stays eager (its soft-capped attention is not SDPA's, and eager's softmax is float32 already), as the
    engine's does."""
    backend = FSDPBackend(
        ModelConfig(path=str(family_dirs[family])), TrainerConfig(precision="bfloat16"), with_reference=False
    )
    assert resolved(backend.model) == trained
