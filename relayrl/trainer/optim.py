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


@torch.no_grad()
def materialize_state(optimizer: torch.optim.AdamW) -> None:
    """Create ``optimizer``'s state now (step 0, zero moments: what its first step would create) instead of in the
    first step, where allocating and zeroing two copies of the trainable parameters is on a step's clock: the FSDP
    backend does it as it loads, before its first batch arrives. One step at lr 0 on zero gradients leaves every
    parameter as it is (p (1 - 0 wd) - 0 m / (sqrt(v) + eps)) and both moments at 0; its step counts are then set
    back to 0."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is None]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for state in optimizer.state.values():
        state["step"].zero_()
    for p in params:
        p.grad = None
