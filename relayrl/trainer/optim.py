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


def create_state(optimizer: torch.optim.Adam) -> None:
    """Create ``optimizer``'s per-parameter state now instead of in its first ``step`` (on a CPU, fresh pages that step
    1 would fault in on its hot path): for every parameter what torch's Adam / AdamW first step makes
    (``Adam._init_group``, torch/optim/adam.py): ``step``, a 0-d zero (float32 on the parameter's device when fused or
    capturable, else on the CPU in the default scalar dtype), and ``exp_avg``, ``exp_avg_sq`` (and under amsgrad
    ``max_exp_avg_sq``) zeros like the parameter. The next step is the one the optimizer would have taken. Nothing
    else is allocated, computed or written. A no-op when state exists (a resumed optimizer)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        raise TypeError(f"optimizer: create_state knows Adam's state, not {type(optimizer).__name__}'s")
    if optimizer.state:
        return
    cpu_step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group["fused"] or group["capturable"]
        moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
        for p in group["params"]:
            step = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if on_device
                else torch.zeros((), dtype=cpu_step_dtype)
            )
            optimizer.state[p] = {"step": step} | {
                name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in moments
            }


def fault_in_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Allocate a zero gradient's memory for every parameter of ``optimizer``, then free it: in a process whose heap
    keeps what it frees (``relayrl.runtime.heap``), step 1's activations and gradients then land on pages faulted in
    now, not on its hot path. Leaves the parameters' ``grad`` as they were."""
    scratch = [torch.zeros_like(p) for group in optimizer.param_groups for p in group["params"]]
    del scratch
