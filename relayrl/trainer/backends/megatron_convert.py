"""Hugging Face <-> Megatron-core weights for dense Qwen2/Llama models, across TP ranks and PP stages.

A ``Unit`` is one Megatron parameter and the Hugging Face tensors it holds. ``shard`` cuts a rank's
piece out of the full HF tensors; ``merge`` rebuilds the full HF tensors from the TP ranks' pieces.
Layouts (megatron-core 0.16, local layer spec):
- ``linear_qkv``: per query group g, rows [q heads of g | k head g | v head g]; TP splits by groups.
- ``linear_fc1`` (SwiGLU): each TP rank holds [gate piece; up piece] (``glu`` takes the first half as gate).
- row-parallel (``linear_proj``, ``linear_fc2``): dim 1 split.
- the vocabulary (embedding, output layer) is padded with zero rows to a multiple of TP, split on dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class Geometry:
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # the HF vocabulary
    padded_vocab: int  # a multiple of TP: Megatron's embedding rows

    @property
    def q_per_group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Unit:
    stage: int  # the pipeline stage that holds it
    local_name: str  # its name in that stage's GPTModel
    hf_names: tuple[str, ...]
    kind: str  # replicated | vocab | row | qkv | gate_up


def geometry(hf_config, tp: int) -> Geometry:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    vocab = hf_config.vocab_size
    return Geometry(heads, hf_config.num_key_value_heads, head_dim, vocab, -(-vocab // tp) * tp)


def layer_stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(stage, local index) of every global layer: stages hold equal consecutive runs (Megatron's default)."""
    if num_layers % pp:
        raise ValueError(f"trainer.megatron.pipeline_parallel: {pp} does not divide the model's {num_layers} layers")
    per = num_layers // pp
    return [(g // per, g % per) for g in range(num_layers)]


def units(hf_config, pp: int, *, qkv_bias: bool) -> list[Unit]:
    """Every Megatron parameter of the model, in the Hugging Face parameter order."""
    last = pp - 1
    out = [Unit(0, "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for g, (stage, i) in enumerate(layer_stages(hf_config.num_hidden_layers, pp)):
        hf, mc = f"model.layers.{g}.", f"decoder.layers.{i}."
        attn = (hf + "self_attn.q_proj.", hf + "self_attn.k_proj.", hf + "self_attn.v_proj.")
        out.append(Unit(stage, mc + "self_attention.linear_qkv.weight", tuple(p + "weight" for p in attn), "qkv"))
        if qkv_bias:
            out.append(Unit(stage, mc + "self_attention.linear_qkv.bias", tuple(p + "bias" for p in attn), "qkv"))
        out += [
            Unit(stage, mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "row"),
            Unit(
                stage, mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "gate_up"
            ),
            Unit(stage, mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"),
            Unit(stage, mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"),
            Unit(stage, mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"),
        ]
    out.append(Unit(last, "decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not hf_config.tie_word_embeddings:
        out.append(Unit(last, "output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def _qkv_groups(full: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """[kv_heads, (q_per_group + 2) * head_dim, ...]: the fused rows, one block per query group."""
    return full.reshape(geo.kv_heads, (geo.q_per_group + 2) * geo.head_dim, *full.shape[1:])


def shard(unit: Unit, hf: dict[str, torch.Tensor], tp_rank: int, tp: int, geo: Geometry) -> torch.Tensor:
    """This TP rank's piece of ``unit`` from the full Hugging Face tensors."""
    tensors = [hf[name] for name in unit.hf_names]
    if unit.kind == "replicated":
        return tensors[0]
    if unit.kind == "vocab":
        padded = torch.zeros(geo.padded_vocab, *tensors[0].shape[1:], dtype=tensors[0].dtype)
        padded[: geo.vocab] = tensors[0]
        return padded.chunk(tp)[tp_rank]
    if unit.kind == "row":
        return tensors[0].chunk(tp, dim=1)[tp_rank]
    if unit.kind == "gate_up":
        return torch.cat([t.chunk(tp)[tp_rank] for t in tensors])
    if unit.kind == "qkv":
        q, k, v = tensors
        per_group = [t.reshape(geo.kv_heads, -1, *t.shape[1:]) for t in (q, k, v)]
        fused = torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])
        return fused.chunk(tp)[tp_rank]
    raise ValueError(f"unknown unit kind {unit.kind!r}")


def merge(unit: Unit, pieces: list[torch.Tensor], geo: Geometry) -> dict[str, torch.Tensor]:
    """The full Hugging Face tensors of ``unit`` from every TP rank's piece (TP rank order)."""
    names = unit.hf_names
    if unit.kind == "replicated":
        return {names[0]: pieces[0]}
    if unit.kind == "vocab":
        return {names[0]: torch.cat(pieces)[: geo.vocab]}
    if unit.kind == "row":
        return {names[0]: torch.cat(pieces, dim=1)}
    if unit.kind == "gate_up":
        halves = [p.chunk(2) for p in pieces]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}
    if unit.kind == "qkv":
        groups = _qkv_groups(torch.cat(pieces), geo)
        q_rows = geo.q_per_group * geo.head_dim
        q, k, v = groups.split([q_rows, geo.head_dim, geo.head_dim], dim=1)
        return {name: t.reshape(-1, *t.shape[2:]) for name, t in zip(names, (q, k, v))}
    raise ValueError(f"unknown unit kind {unit.kind!r}")


def tied_output_unit(hf_config, pp: int) -> Unit | None:
    """With tied embeddings over several stages, the last stage holds a copy of the embedding as its output
    layer: loaded from the same HF tensor (never gathered: the first stage's copy is the weight)."""
    if not hf_config.tie_word_embeddings or pp == 1:
        return None
    return Unit(pp - 1, "output_layer.weight", ("model.embed_tokens.weight",), "vocab")
