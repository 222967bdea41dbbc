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


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s per-parameter state now instead of in its first ``step`` (AdamW: two float32 moments
    the size of its parameters; on a CPU, fresh pages that step 1 would fault in on its hot path): one step on zero
    gradients at lr 0, as torch.distributed.checkpoint readies an optimizer to load into
    (``_init_optim_state``, torch/distributed/checkpoint/state_dict.py), then every ``step`` count back to 0.
    Nothing moves (the update and AdamW's decay are scaled by lr = 0); the moments are zero, as step 1 creates
    them; so the next step is the one the optimizer would have taken. A no-op when state exists (a resumed
    optimizer) or a parameter holds a gradient."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()  # a tensor in torch's AdamW
