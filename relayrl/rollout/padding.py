"""Left padding of a prompt batch, shared by the hf engine's runners: prompts aligned right, positions counted
from each prompt's first real token."""

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


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: real tokens count from 0 whatever the padding before them."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)
