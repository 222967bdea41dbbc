"""Hugging Face <-> Megatron-core weight layout: every HF tensor is held by exactly one unit, and cutting a
rank's piece then merging every rank's pieces gives the HF tensors back, for each kind of unit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from relayrl.trainer.backends.megatron_convert import Unit, geometry, layer_stages, merge, shard, units
from relayrl.trainer.backends.megatron_model import check_supported, has_qkv_bias


def qwen2(**extra) -> Qwen2Config:
    sizes = dict(vocab_size=23, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    return Qwen2Config(**sizes, num_key_value_heads=2, **extra)


def hf_names(config) -> set[str]:
    from transformers import AutoModelForCausalLM

    return {name for name, _ in AutoModelForCausalLM.from_config(config).named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pp", [1, 2])
def test_units_cover_every_hf_weight_once(tied, pp):
    config = qwen2(tie_word_embeddings=tied)
    layout = units(config, pp, qkv_bias=has_qkv_bias(config))
    names = [name for unit in layout for name in unit.hf_names]
    assert len(names) == len(set(names)) and set(names) == hf_names(config)
    assert {u.stage for u in layout} == set(range(pp))
    assert [s for s, _ in layer_stages(4, pp)] == [g * pp // 4 for g in range(4)]


def test_llama_without_attention_bias_has_no_qkv_bias_unit():
    config = LlamaConfig(vocab_size=23, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    check_supported(config)
    layout = units(config, 1, qkv_bias=has_qkv_bias(config))
    assert {name for u in layout for name in u.hf_names} == hf_names(config)


def test_unsupported_models_and_layouts_fail_naming_the_field():
    with pytest.raises(ValueError, match="hidden_act"):
        check_supported(qwen2(hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"tensor_parallel: 4 does not divide the model's num_key_value_heads \(2\)"):
        check_supported(qwen2(), tp=4)
    with pytest.raises(ValueError, match="pipeline_parallel: 3 does not divide"):
        layer_stages(4, 3)


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_then_merge_gives_the_hf_tensors_back(tp):
    config = qwen2()
    geo = geometry(config, tp)
    g = torch.Generator().manual_seed(0)
    hf = {}
    for unit in units(config, 2, qkv_bias=True):
        for name in unit.hf_names:
            shape = {
                "model.embed_tokens.weight": (23, 32), "lm_head.weight": (23, 32),
                "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
                "self_attn.v_proj.weight": (16, 32), "self_attn.q_proj.bias": (32,), "self_attn.k_proj.bias": (16,),
                "self_attn.v_proj.bias": (16,), "self_attn.o_proj.weight": (32, 32), "mlp.gate_proj.weight": (64, 32),
                "mlp.up_proj.weight": (64, 32), "mlp.down_proj.weight": (32, 64),
            }.get(name.split(".", 3)[-1] if name.startswith("model.layers") else name, (32,))  # fmt: skip
            hf[name] = torch.randn(shape, generator=g)
    for unit in units(config, 2, qkv_bias=True):
        pieces = [shard(unit, hf, r, tp, geo) for r in range(tp)]
        if unit.kind == "vocab":
            assert sum(p.shape[0] for p in pieces) == geo.padded_vocab == -(-23 // tp) * tp
        back = merge(unit, pieces, geo)
        assert set(back) == set(unit.hf_names)
        for name in unit.hf_names:
            assert torch.equal(back[name], hf[name]), name


def test_qkv_piece_holds_its_query_groups_heads_in_megatron_order():
    """Rank r of TP=2 holds query group r: [q heads 2r, 2r+1 | k head r | v head r] (head_dim 8)."""
    geo = geometry(qwen2(), 2)
    q, k, v = (torch.arange(n * 8).repeat_interleave(1).float().reshape(n * 8, 1) + off
               for n, off in ((4, 0), (2, 100), (2, 200)))  # fmt: skip
    unit = Unit(0, "x", ("q", "k", "v"), "qkv")
    piece = shard(unit, {"q": q, "k": k, "v": v}, 1, 2, geo)
    assert torch.equal(piece, torch.cat([q[16:32], k[8:16], v[8:16]]))
