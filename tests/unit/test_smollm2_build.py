"""relayrl.models.smollm2: the GGUF's tensors in the Hugging Face Llama layout (the whole build, on the real file:
tests/integration/test_real_model.py)."""

from __future__ import annotations

import re

import pytest
import torch

from relayrl.models.smollm2 import hf_name, unpermute_rotary


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter stores for a q or k projection: each head's rows [2, half] interleaved to
    [half, 2], i.e. Hugging Face row ``r * half + j`` of a head becomes row ``2j + r``."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (3, 64), (2, 8)])
def test_unpermute_rotary_undoes_the_gguf_layout_row_by_row(heads: int, head_dim: int) -> None:
    hf = torch.arange(heads * head_dim, dtype=torch.float32)[:, None] * torch.ones(1, 5)  # row i holds i
    stored = llama_cpp_permute(hf, heads)
    half = head_dim // 2
    assert stored[1, 0] == half and stored[2, 0] == 1  # a head's second row is its second half's first
    assert torch.equal(unpermute_rotary(stored, heads), hf)


def test_gguf_names_map_to_the_llama_modules_and_an_unknown_one_is_refused() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.29.attn_output.weight") == "model.layers.29.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match=re.escape("'blk.0.ssm_in.weight' is not one of a Llama model's")):
        hf_name("blk.0.ssm_in.weight")
