"""The trainer's optimizer, one for every backend."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from relayrl.config import TrainerConfig


def adamw(params: Iterable[torch.nn.Parameter], cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW (``trainer.lr``, ``betas``, ``weight_decay``) on torch's fused kernel: one kernel per parameter
    instead of a dozen elementwise ops, equal to the single-tensor loop up to float rounding. transformers'
    Trainer has defaulted to it since torch 2.8 (``adamw_torch_fused``, transformers/training_args.py), so TRL's
    GRPOTrainer runs it too. FSDP2's DTensor parameters take it as well."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
