"""A Megatron-core ``GPTModel`` (local layer spec) built from a dense Qwen2/Llama Hugging Face config."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relayrl.trainer.backends.megatron_convert import SUPPORTED_MODEL_TYPES


def check_supported(hf_config, tp: int = 1) -> None:
    """Dense Qwen2/Llama with SiLU gated MLPs and plain RoPE, heads and key/value heads divisible by TP;
    anything else is a clear error."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(hf_config, field) % tp:
            raise ValueError(
                f"trainer.megatron.tensor_parallel: {tp} does not divide the model's {field} "
                f"({getattr(hf_config, field)})"
            )
    kind = hf_config.model_type
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model.path: the megatron backend supports {SUPPORTED_MODEL_TYPES}, not {kind!r}")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"model.path: hidden_act {hf_config.hidden_act!r} (the megatron backend needs silu)")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"model.path: rope_type {rope.get('rope_type')!r} (the megatron backend needs default RoPE)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("model.path: mlp_bias is not supported by the megatron backend")


def has_qkv_bias(hf_config) -> bool:
    """Qwen2 always has q/k/v biases; Llama has them when ``attention_bias``."""
    return hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))


def rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(hf_config, *, tp: int, pp: int, dtype: torch.dtype):
    """The TransformerConfig of ``hf_config``: RMSNorm, SwiGLU, RoPE, GQA, no dropout, no fused kernels."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = hf_config.num_attention_heads
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded from the Hugging Face directory
    )


def build_gpt_model(hf_config, *, tp: int, pp: int, pp_rank: int, padded_vocab: int, dtype: torch.dtype):
    """This pipeline stage's GPTModel: the embedding on the first stage, the output layer on the last."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=transformer_config(hf_config, tp=tp, pp=pp, dtype=dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,  # vocab-parallel logits: log-probs through the vocab-parallel cross-entropy
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    mark_tensor_parallel_weights(model)
    return model


def mark_tensor_parallel_weights(model) -> None:
    """megatron-core sets ``tensor_model_parallel`` on a layer's weight only while initializing it
    (tensor_parallel/layers.py); with ``perform_initialization=False`` it is missing, and the gradient norm
    would count each TP slice as a duplicate. Set it as initialization would: split dim 0 for the embedding and
    column-parallel layers, dim 1 for row-parallel ones."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        parallel = isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding)
        if parallel and getattr(module, "weight", None) is not None:
            set_tensor_model_parallel_attributes(module.weight, is_parallel=True, dim=dim, stride=1)
