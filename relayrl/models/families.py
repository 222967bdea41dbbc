"""Tiny models of the families users train with RL, and which fast path each family is claimed exact on.

Each family is built from its own transformers config class (random init, seeded, float32, 2 layers, hidden 32,
the tiny word-level tokenizer of ``models/tiny.py``), with the features that set it apart kept on and sized so a
test's sequences (~12-40 tokens) meet them: sliding windows of ``WINDOW`` tokens, Gemma2's logit soft-capping,
Granite's logit and residual scaling, mixture-of-experts layers, attention sinks.

``CLAIMS`` is the one declaration of what each fast path does on each family: ``exact`` (equal to the plain
model forward: float32 within 1e-5), ``falls back`` (the path is not taken; the plain forward runs instead and a
log line says why: ``Claim.reason``) or ``refused`` (the config is refused, naming the key). The trainer's matrix
test (tests/unit/test_families.py) checks every claim against the code, and docs/model-families.md's table is
generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from relayrl.models.tiny import build_tokenizer

# sliding window of the windowed families: shorter than a test's sequences, so the window masks something
WINDOW = 6
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
HEAD_DIM = SIZES["hidden_size"] // SIZES["num_attention_heads"]
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ALTERNATING = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    """A family's tiny model: its transformers config class and model class (names in ``transformers``), the
    config's family-specific keys, and the title the docs table shows."""

    title: str
    config_class: str
    model_class: str
    keys: dict

    def config(self, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
        ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        ids["bos_token_id"] = tokenizer.eos_token_id
        keys = SIZES | {"vocab_size": len(tokenizer), "dtype": "float32"} | ids | self.keys
        return getattr(transformers, self.config_class)(**keys)


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "Llama 3 (llama3 RoPE scaling, untied head)", "LlamaConfig", "LlamaForCausalLM",
        {"tie_word_embeddings": False, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }},
    ),
    "llama-dynamic": Family(
        "Llama, dynamic-NTK RoPE scaling", "LlamaConfig", "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "qwen2": Family("Qwen2 / Qwen2.5", "Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2-window": Family(
        f"Qwen2, sliding window {WINDOW} on layer 2", "Qwen2Config", "Qwen2ForCausalLM",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen2-moe": Family(
        "Qwen2-MoE (4 experts top 2, a shared expert)", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        MOE | {"shared_expert_intermediate_size": 32},
    ),
    "qwen3": Family("Qwen3 (q/k norms)", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": HEAD_DIM}),
    "qwen3-moe": Family(
        "Qwen3-MoE (4 experts, top 2)", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": HEAD_DIM} | MOE
    ),
    "mistral": Family(
        f"Mistral, sliding window {WINDOW}", "MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}
    ),
    "gemma2": Family(
        f"Gemma2 (logit soft-capping, sliding window {WINDOW} on alternate layers)", "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": WINDOW,
         "layer_types": ALTERNATING, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
    "gemma3": Family(
        f"Gemma3 (q/k norms, sliding window {WINDOW} on alternate layers)", "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": WINDOW,
         "layer_types": ALTERNATING},
    ),
    "phi3": Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": Family("OLMo2", "Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": Family(
        "Granite (logits_scaling 8, embedding, residual and attention multipliers)", "GraniteConfig",
        "GraniteForCausalLM",
        {"logits_scaling": 8.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
         "attention_multiplier": 0.015625},
    ),
    "gpt-oss": Family(
        f"gpt-oss (attention sinks, 4 experts top 2, sliding window {WINDOW} on alternate layers)", "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
         "layer_types": ALTERNATING, "rope_parameters": {
             "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         }},
    ),
}  # fmt: skip


def build_family_model(
    family: str, *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None
) -> PreTrainedModel:
    """``family``'s tiny model (a key of ``FAMILIES``), randomly initialised from ``seed``, float32, eval mode."""
    if family not in FAMILIES:
        raise ValueError(f"family: unknown {family!r} (one of {', '.join(FAMILIES)})")
    spec = FAMILIES[family]
    config = spec.config(tokenizer or build_tokenizer())
    torch.manual_seed(seed)
    return getattr(transformers, spec.model_class)(config).eval()


def write_family_model(family: str, path: str | Path, *, seed: int = 0) -> Path:
    """``family``'s tiny model and its tokenizer saved as a Hugging Face model directory; returns the path."""
    path = Path(path)
    tokenizer = build_tokenizer()
    build_family_model(family, seed=seed, tokenizer=tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_near_tied_moe(path: str | Path, *, seed: int = 0, spread: float = 1e-5, expert_scale: float = 30.0) -> Path:
    """The qwen2-moe tiny model with near-tied routers, saved as a model directory (the routing replay demo): every
    expert's router row is the first expert's plus ``spread`` x the rows' std of seeded noise, so a token's router
    logits differ far below a bf16 ulp (bf16 rounds them into ties, float32 keeps them apart: an engine in bf16 and
    a trainer in float32 pick other experts for most tokens), and the experts' down projections are scaled by
    ``expert_scale`` so that the experts a token takes move its logprobs."""
    tokenizer = build_tokenizer()
    model = build_family_model("qwen2-moe", seed=seed, tokenizer=tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.copy_(
                gate[:1] + spread * gate.std() * torch.randn(gate.shape, generator=torch.Generator().manual_seed(seed))
            )
            layer.mlp.experts.down_proj.mul_(expert_scale)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@dataclass(frozen=True)
class Claim:
    """What a fast path does on a family: ``status`` one of ``STATUSES``; ``reason`` (not exact): the words of the
    log line or the refusal that says why."""

    status: str = "exact"
    reason: str = ""


STATUSES = ("exact", "falls back", "refused")
# the trainer's fast paths (trainer.shared_prefix, the chunked output head, trainer.padding_free,
# trainer.precision bf16, model.lora), each compared with the plain model forward by tests/unit/test_families.py
TRAINER_PATHS = ("shared_prefix", "chunked_head", "padding_free", "bf16", "lora")
# the hf engine's paths, each compared with the trainer's logprobs by tests/unit/test_engine_families.py:
# hf_fast_decoder (relayrl/rollout/llama_decode.py; where it falls back, the transformers forward decodes, exactly),
# hf_prefix_cache (rollout.prefix_cache_tokens: a prompt continuing a finished row prefills only its new tokens)
ENGINE_PATHS = ("hf_fast_decoder", "hf_prefix_cache")
PATHS = TRAINER_PATHS + ENGINE_PATHS

# family -> path -> claim, where a path is not exact on a family (every other pair: exact)
NOT_EXACT: dict[str, dict[str, Claim]] = {
    "gemma2": {"chunked_head": Claim("falls back", "its logits are not a scale times the head's matmul")},
    "llama-dynamic": dict.fromkeys(
        ("shared_prefix", "padding_free"),
        Claim("falls back", "rope_type dynamic rescales the rotary frequencies by each forward's longest position"),
    ),
}


# the fast decoder reproduces Llama / Mistral / Qwen2 / Qwen3 decoders op for op, full attention only: every other
# family decodes with the transformers forward, and the engine logs why (llama_decode.unsupported_reason)
FAST_DECODER_FALLBACKS = {
    "qwen2-window": "sliding-window attention",
    "mistral": "sliding-window attention",
    "llama-dynamic": "rope type 'dynamic'",
    **{
        family: f"model_type {model_type!r} is not one of llama, mistral, qwen2, qwen3"
        for family, model_type in (
            ("qwen2-moe", "qwen2_moe"), ("qwen3-moe", "qwen3_moe"), ("gemma2", "gemma2"), ("gemma3", "gemma3_text"),
            ("phi3", "phi3"), ("olmo2", "olmo2"), ("granite", "granite"), ("gpt-oss", "gpt_oss"),
        )
    },
}  # fmt: skip
for _family, _reason in FAST_DECODER_FALLBACKS.items():
    NOT_EXACT.setdefault(_family, {})["hf_fast_decoder"] = Claim("falls back", _reason)


def claim(family: str, path: str) -> Claim:
    """The declared claim of ``path`` (of ``PATHS``) on ``family`` (of ``FAMILIES``)."""
    return NOT_EXACT.get(family, {}).get(path, Claim())
