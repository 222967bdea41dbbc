"""A lean decode step for Llama-family decoders (Llama, Mistral, Qwen2 and Qwen3, without a sliding window).

The transformers forward spends most of a small model's decode step in Python: mask construction, output
capturing, config lookups, a ``torch.cat`` of the whole KV cache per layer per step. ``LlamaDecodeRunner``
decodes one token per row with a handful of tensor ops per layer, reading **the model's own parameters**
(never copies: weights loaded in place, or swapped with ``.data``, are what the next step uses):

    h = x + o_proj(attention(rope(q_norm(q_proj(rms1(x)))), cache + rope(k_norm(k_proj(rms1(x)))),
                             cache + v_proj(rms1(x))))
    x' = h + down_proj(silu(gate_proj(rms2(h))) * up_proj(rms2(h)))
    logits = lm_head(norm(x_last))

with rms(x) = weight * (x_f32 * rsqrt(mean(x_f32²) + eps)).to(dtype), q_norm / k_norm that rms over each head
(Qwen3's; the identity elsewhere), rope(x) = x cos + rotate_half(x) sin at angle position * inv_freq (cos and sin
times the rotary's attention_scaling: YaRN's), and attention = softmax(q kᵀ / sqrt(head_dim) + pad mask) v of each
query head against its KV head (GQA): the same operations, in the same order and dtypes, as transformers'
modeling_llama.py / modeling_qwen2.py / modeling_qwen3.py (eager attention, which its SDPA equals), so every
logprob equals the trainer's up to float rounding.

The joining prompts are prefilled here too, each once, left-padded as in the transformers runner (positions
cumsum(mask) - 1): the same layer formulas over all their tokens at once, attention through SDPA (what
transformers' "sdpa" computes) under the causal mask restricted to real keys; a pad's query row has no key to
attend to, and SDPA answers zeros for it (torch >= 2.5), so pads stay finite and, masked, never reach a real
token. A prompt whose prefix the prefix cache holds (``relayrl.rollout.prefix_cache``) forwards only its tokens
after it, at positions after the prefix's, each attending to the prefix's cached keys and the new ones up to
itself; such prompts are prefilled together, the prefixes' KV aligned right before the left-padded new tokens
(``padding.cached_prefix_layout``: a row's pads sit between the two, and every mask is per column). Its keys and
values become a ``KVState``: per layer one preallocated [rows, kv_heads, columns,
head_dim] buffer whose live columns are [start, end). A decode step writes column ``end`` for every row, so
no step copies the cache; the buffer grows geometrically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from relayrl.rollout.lora import LORA_ATTR
from relayrl.rollout.padding import cached_prefix_layout, left_pad, left_pad_kv, position_ids
from relayrl.rollout.prefix_cache import CachedPrefix

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose inv_freq is fixed at load (transformers' dynamic_rope_update changes "dynamic" and "longrope"
# per forward, by the sequence length)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``LlamaDecodeRunner`` cannot decode ``model`` exactly, or None when it can.

    Checked: config.model_type in MODEL_TYPES; attention implementation "sdpa" or "eager" (the same softmax
    attention, which this runner computes);
    every layer full attention (no sliding window shorter than max_position_embeddings); a RoPE type of ROPE_TYPES
    rotating the whole head; hidden_act "silu"; every projection a plain ``nn.Linear`` (no quantized or
    adapter-wrapped layers); the ``model.embed_tokens / layers / norm / rotary_emb`` + ``lm_head`` layout of
    transformers' *ForCausalLM.
    """
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r} (the fast path computes 'sdpa'/'eager')"
    window = getattr(config, "sliding_window", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (window is not None and window < config.max_position_embeddings):
        return f"sliding-window attention (layer_types {sorted(layer_types)}, sliding_window {window})"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} (the fast path computes silu)"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the model.embed_tokens/layers/norm/rotary_emb layout"
    if base.rotary_emb.rope_type not in ROPE_TYPES:
        return f"rope type {base.rotary_emb.rope_type!r} (the fast path computes {', '.join(ROPE_TYPES)})"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * base.rotary_emb.inv_freq.numel() != head_dim:
        return f"partial rotary embedding ({2 * base.rotary_emb.inv_freq.numel()} of {head_dim} head dims)"
    if len(base.layers) != config.num_hidden_layers:
        return f"{len(base.layers)} layers but config.num_hidden_layers {config.num_hidden_layers}"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not nn.Linear for m in linears) or type(model.lm_head) is not nn.Linear:
            return f"layer {i} has a projection that is not a plain nn.Linear (quantized or wrapped)"
    return None


class KVState:
    """Rows being decoded: per layer keys/values [row capacity, kv_heads, column capacity, head_dim] whose live
    part is rows [0, rows) x columns [start, end); ``mask`` [row capacity, column capacity] (False = pad);
    ``next_pos`` [rows]: the position the next token of each row takes."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, next_pos: torch.Tensor
    ) -> None:
        """Adopt a compact cache: keys/values [rows, kv_heads, width, head_dim], mask [rows, width]."""
        rows, width = mask.shape
        self.rows, self.start, self.end = rows, 0, width
        self.keys, self.values = keys, values
        self.mask = mask.bool()
        self.next_pos = next_pos
        self.has_pads = not bool(self.mask.all())

    def _reserve(self, rows: int, columns: int, extra: int) -> None:
        """Make room for ``rows`` rows and live columns [end - columns, end + extra): re-laid out (live data
        copied to a new, larger buffer) only when the current one lacks the room."""
        row_cap, col_cap = self.mask.shape
        if rows <= row_cap and self.end - columns >= 0 and self.end + extra <= col_cap:
            return
        new_rows = row_cap if rows <= row_cap else max(rows, 2 * row_cap)  # both grow geometrically
        new_cols = max(2 * (columns + extra), 32)
        width = self.end - self.start
        dst = slice(columns - width, columns)  # live columns land right-aligned at [.., columns)
        for layer in range(len(self.keys)):
            for buffers in (self.keys, self.values):
                old = buffers[layer]
                new = old.new_empty((new_rows, old.shape[1], new_cols, old.shape[3]))
                new[: self.rows, :, dst] = old[: self.rows, :, self.start : self.end]
                buffers[layer] = new
        mask = self.mask.new_zeros((new_rows, new_cols))
        mask[: self.rows, dst] = self.mask[: self.rows, self.start : self.end]
        self.mask, self.start, self.end = mask, columns - width, columns

    def append_column(self) -> int:
        """Open column ``end`` for one more token of every row; returns its index."""
        self._reserve(self.rows, self.end - self.start, 1)
        self.mask[: self.rows, self.end] = True
        self.end += 1
        return self.end - 1

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) the rows at ``index``, in that order; columns only pads still use are dropped."""
        count = len(index)
        self._reserve(count, self.end - self.start, 0)
        live = slice(self.start, self.end)
        # rows that stay where they are (a kept prefix) are not copied
        moved = (index != torch.arange(count, device=index.device)).nonzero()
        first = int(moved[0]) if len(moved) else count
        rest, source = slice(first, count), index[first:]
        for buffer in (*self.keys, *self.values):
            buffer[rest, :, live] = buffer[source, :, live]
        self.mask[rest, live] = self.mask[source, live]
        self.rows, self.next_pos = count, self.next_pos[index]
        used = self.mask[:count, live].any(dim=0)
        self.start += int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        self.has_pads = not bool(self.mask[:count, self.start : self.end].all())

    def merge(self, other: KVState) -> None:
        """Append ``other``'s rows after these, both left-padded to the wider of the two (pads: zeros)."""
        mine, theirs = self.end - self.start, other.end - other.start
        width, rows = max(mine, theirs), self.rows + other.rows
        self._reserve(rows, width, 0)
        old_start, self.start = self.start, self.end - width
        pad_mine, pad_theirs = slice(self.start, old_start), slice(self.start, self.end - theirs)
        new_rows = slice(self.rows, rows)
        for layer in range(len(self.keys)):
            for buffers, sources in ((self.keys, other.keys), (self.values, other.values)):
                buffer = buffers[layer]
                buffer[: self.rows, :, pad_mine] = 0
                buffer[new_rows, :, pad_theirs] = 0
                buffer[new_rows, :, self.end - theirs : self.end] = sources[layer][
                    : other.rows, :, other.start : other.end
                ]
        self.mask[: self.rows, pad_mine] = False
        self.mask[new_rows, pad_theirs] = False
        self.mask[new_rows, self.end - theirs : self.end] = other.mask[: other.rows, other.start : other.end]
        self.rows, self.next_pos = rows, torch.cat([self.next_pos, other.next_pos])
        self.has_pads = not bool(self.mask[:rows, self.start : self.end].all())


class LlamaDecodeRunner:
    """``ModelRunner`` for the batcher: prefill and decode steps computed here (module docstring), sampling
    through ``prefiller`` (the transformers runner). ``unsupported_reason(model)`` must be None."""

    def __init__(self, model: nn.Module, prefiller: Any) -> None:
        self.model, self.prefiller, self.device = model, prefiller, prefiller.device
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.rope_scaling = float(model.model.rotary_emb.attention_scaling)
        self.sample = prefiller.sample

    def prefill(self, prompts: Sequence[Sequence[int]], expand: torch.Tensor) -> tuple[torch.Tensor, KVState]:
        """Forward each prompt once (module docstring); row i continues prompt ``expand[i]``. Returns the
        last-position logits [len(expand), V] and the rows' ``KVState``."""
        input_ids, mask = left_pad(prompts, self.device)
        positions = position_ids(mask)
        width = input_ids.shape[1]
        allowed = torch.ones(width, width, dtype=torch.bool, device=self.device).tril_() & mask.bool()[:, None, None]
        logits, keys, values = self._forward(input_ids, positions, allowed)
        state = KVState(keys, values, mask, positions[:, -1] + 1)
        state.select(expand)
        return logits[expand], state

    def prefill_cached(
        self, prefixes: Sequence[CachedPrefix], suffixes: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, KVState]:
        """Forward each suffix after its cached prefix (``padding.cached_prefix_layout``): the rows' formulas of
        ``prefill``, with the prefixes' keys and values in front of each layer's, a suffix token attending to its
        row's real keys up to itself. Returns the logits [B, V] and the rows' ``KVState`` (prefix and suffix)."""
        input_ids, mask, positions = cached_prefix_layout([len(p.tokens) for p in prefixes], suffixes, self.device)
        past, width = mask.shape[1] - input_ids.shape[1], input_ids.shape[1]
        causal = torch.ones(width, past + width, dtype=torch.bool, device=self.device).tril_(diagonal=past)
        kv = [
            (left_pad_kv([p.keys[i] for p in prefixes], past), left_pad_kv([p.values[i] for p in prefixes], past))
            for i in range(len(prefixes[0].keys))
        ]
        logits, keys, values = self._forward(input_ids, positions, causal & mask[:, None, None], kv)
        return logits, KVState(keys, values, mask, positions[:, -1] + 1)

    @staticmethod
    def row_kv(state: KVState, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row ``row``'s keys and values at its last ``length`` real columns (pads skipped), per layer
        [kv_heads, length, head_dim]."""
        live = slice(state.start, state.end)
        real = state.mask[row, live].nonzero().squeeze(1)[-length:] + state.start
        return [k[row][:, real] for k in state.keys], [v[row][:, real] for v in state.values]

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The layers over input_ids [B, W] at ``positions`` [B, W], query-key pairs ``allowed`` (bool, broadcast
        to [B, heads, W, C + W]), after ``past``'s keys and values per layer ([B, kv_heads, C, head_dim]) when
        given: the last position's logits [B, V] and each layer's keys and values [B, kv_heads, C + W, head_dim]."""
        base = self.model.model
        count, width = input_ids.shape
        cos, sin = self._rotary(positions, base.embed_tokens.weight.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [P, 1, W, head_dim]: broadcast over heads
        keys, values = [], []
        x = F.embedding(input_ids, base.embed_tokens.weight)
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            q = _head_norm(_linear(h, attn.q_proj).view(count, width, self.heads, self.head_dim), attn, "q_norm")
            k = _head_norm(_linear(h, attn.k_proj).view(count, width, self.kv_heads, self.head_dim), attn, "k_norm")
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            v = _linear(h, attn.v_proj).view(count, width, self.kv_heads, self.head_dim).transpose(1, 2)
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            keys.append(k.contiguous())
            values.append(v.contiguous())
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.scaling, enable_gqa=self.heads != self.kv_heads
            )
            x = x + _linear(out.transpose(1, 2).reshape(count, width, self.heads * self.head_dim), attn.o_proj)
            h = _rms_norm(x, layer.post_attention_layernorm)
            x = x.add_(_mlp(h, layer.mlp))
        return _linear(_rms_norm(x[:, -1], base.norm), self.model.lm_head), keys, values

    def decode(self, state: KVState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [B]; returns the next logits [B, V] (module docstring's formulas)."""
        base = self.model.model
        rows, dtype = len(tokens), base.embed_tokens.weight.dtype
        column = state.append_column()
        cos, sin = self._rotary(state.next_pos, dtype)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, head_dim]: broadcast over heads
        state.next_pos = state.next_pos + 1
        live = slice(state.start, state.end)
        pads = None
        if state.has_pads:  # additive: -inf on the pads, shared by every layer and head
            pads = torch.zeros(rows, state.end - state.start, dtype=dtype, device=tokens.device)
            pads = pads.masked_fill_(~state.mask[:rows, live], float("-inf"))[:, None, None]
        group = self.heads // self.kv_heads
        x = F.embedding(tokens, base.embed_tokens.weight)
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            # GQA without repeating the cache: query head g * group + r attends with KV head g, so the queries
            # are laid out [B, kv_heads, group, head_dim] (transformers' pack_gqa)
            q = _head_norm(_linear(h, attn.q_proj).view(rows, self.kv_heads, group, self.head_dim), attn, "q_norm")
            q = _rope(q, cos[:, None], sin[:, None])
            k = _rope(
                _head_norm(_linear(h, attn.k_proj).view(rows, self.kv_heads, self.head_dim), attn, "k_norm"), cos, sin
            )
            keys, values = state.keys[i], state.values[i]
            keys[:rows, :, column] = k
            values[:rows, :, column] = _linear(h, attn.v_proj).view(rows, self.kv_heads, self.head_dim)
            out = self._attention(q, keys[:rows, :, live], values[:rows, :, live], pads)
            x = x.add_(_linear(out.view(rows, self.heads * self.head_dim), attn.o_proj))
            h = _rms_norm(x, layer.post_attention_layernorm)
            x = x.add_(_mlp(h, layer.mlp))
        return _linear(_rms_norm(x, base.norm), self.model.lm_head)

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pads: torch.Tensor | None
    ) -> torch.Tensor:
        """softmax(q kᵀ · scaling + pads) v per KV head, the softmax in float32: transformers' eager attention
        (which its SDPA path equals). Written out rather than through SDPA: for one query per row its two
        batched matmuls cost less than SDPA's CPU kernel, and, unlike it, they do not slow down when the
        other core is busy."""
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scaling)
        if pads is not None:
            scores = scores.add_(pads)
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, head_dim] of angle position * inv_freq (duplicated halves), times the
        rotary's attention_scaling, computed in float32 and cast to the model dtype as transformers does; sin's
        first half negated so that rotate_half(x) * sin becomes swap_halves(x) * sin (negation is exact)."""
        inv_freq = self.model.model.rotary_emb.inv_freq
        freqs = positions[..., None].float() * inv_freq.float()
        cos, sin = torch.cat([freqs, freqs], dim=-1).cos(), freqs.sin()
        if self.rope_scaling != 1.0:
            cos, sin = cos * self.rope_scaling, sin * self.rope_scaling
        return cos.to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def _linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """x Wᵀ + b, plus the module's LoRA adapter when one is loaded (relayrl.rollout.lora)."""
    out = F.linear(x, module.weight, module.bias)
    adapter = module.__dict__.get(LORA_ATTR)
    return out if adapter is None else adapter.add_to(out, x)


def _mlp(h: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """down_proj(silu(gate_proj(h)) * up_proj(h)), in place on its own intermediates."""
    return _linear(F.silu(_linear(h, mlp.gate_proj), inplace=True).mul_(_linear(h, mlp.up_proj)), mlp.down_proj)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """weight * (x_f32 * rsqrt(mean(x_f32²) + eps)).to(x.dtype): transformers' Qwen2RMSNorm / LlamaRMSNorm."""
    upcast = x.float()
    upcast = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * upcast.to(x.dtype)


def _head_norm(x: torch.Tensor, attn: nn.Module, name: str) -> torch.Tensor:
    """x [..., head_dim] through the attention's per-head RMSNorm ``name`` (Qwen3's q_norm / k_norm), where it has
    one; x itself otherwise."""
    norm = attn._modules.get(name)  # a dict lookup: getattr of a missing submodule raises inside nn.Module
    return x if norm is None else _rms_norm(x, norm)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin for x [B, ..., head_dim] (cos, sin broadcast), ``sin``'s first half pre-negated."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin
