"""Left padding of a prompt batch, shared by the hf engine's runners: prompts aligned right, positions counted
from each prompt's first real token; and the layout of rows that continue cached prefixes (their KV, then their
new tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, max_len] int64, prompts aligned right; pads are id 0, mask 0."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


def left_pad_kv(tensors: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row keys or values [kv_heads, length_i, head_dim] stacked as [rows, kv_heads, width, head_dim], each
    aligned right, zeros before it."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[0], width, first.shape[2]))
    for i, tensor in enumerate(tensors):
        out[i, :, width - tensor.shape[1] :] = tensor
    return out


def cached_prefix_layout(
    prefix_lengths: Sequence[int], suffixes: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows continuing cached prefixes: (suffix input_ids [B, S], attention mask [B, P + S] bool, positions [B, S]).

    Columns [0, P) hold the prefixes' KV aligned right (P = the longest prefix), [P, P + S) the suffixes, left-padded:
    a row's pads sit between its prefix and its suffix. Suffix token j of a row with prefix length p and s suffix
    tokens takes position p + j - (S - s)."""
    input_ids, suffix_mask = left_pad(suffixes, device)
    lengths = torch.tensor(list(prefix_lengths), device=device)
    past = int(lengths.max())
    prefix_mask = torch.arange(past, device=device) >= (past - lengths)[:, None]
    mask = torch.cat([prefix_mask, suffix_mask.bool()], dim=1)
    return input_ids, mask, lengths[:, None] + position_ids(suffix_mask)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: real tokens count from 0 whatever the padding before them."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)
