"""KTO (Ethayarajh et al. 2024): the unpaired preference loss, as TRL's ``KTOTrainer`` computes it.

Each example is one completion with a label: desirable (True) or undesirable (False). Its log-ratio
ρ_i = log π(y_i | x_i) − log π_ref(y_i | x_i) uses sequence log-probs (``sequence_logprobs``: sums over the
completion tokens). The reference point z0 estimates KL(π || π_ref) from *mismatched* pairs: each prompt with another
example's completion (``mismatched_completions``), scored by the policy (no gradient) and the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")


def mismatched_completions(completions: Sequence[T]) -> list[T]:
    """The completion each example is paired with for the KL estimate: the batch's completions shifted by one,
    ``[c_{B-1}, c_0, c_1, ..., c_{B-2}]`` (TRL's ``KL_completion_ids``), so row i's prompt meets row i−1's completion.
    Needs B >= 2: with one example the KL pair would be the example itself."""
    if len(completions) < 2:
        raise ValueError(
            f"completions: the KL estimate pairs a prompt with another example's completion; got "
            f"{len(completions)} example(s), need >= 2"
        )
    return [completions[-1], *completions[:-1]]


def kto_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean_i (log π(y'_i | x_i) − log π_ref(y'_i | x_i))), detached: a scalar.

    ``kl_logps`` / ``ref_kl_logps`` [B] are the sequence log-probs of the mismatched pairs under the policy and the
    reference. A data-parallel caller averages the differences over every rank before the clamp (TRL gathers them)."""
    if kl_logps.dim() != 1 or kl_logps.numel() == 0:
        raise ValueError(f"kl_logps: expected a 1-D tensor [B] of B >= 1, got shape {tuple(kl_logps.shape)}")
    if ref_kl_logps.shape != kl_logps.shape:
        raise ValueError(
            f"ref_kl_logps: expected shape {tuple(kl_logps.shape)} like kl_logps, got {tuple(ref_kl_logps.shape)}"
        )
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float,
    kl: torch.Tensor | float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO's per-example loss [B] (TRL ``loss_type="kto"``); the batch loss is its mean.

    ρ_i    = logps_i − ref_logps_i
    loss_i = λ_D · (1 − σ(β · (ρ_i − z0)))     desirable examples
    loss_i = λ_U · (1 − σ(β · (z0 − ρ_i)))     undesirable examples

    z0 is ``kl`` (``kto_reference_point``; no gradient flows through it), λ_D / λ_U are ``desirable_weight`` /
    ``undesirable_weight`` (KTO's paper suggests λ_D·n_D / (λ_U·n_U) in [1, 4/3] on unbalanced data). Metrics (TRL's
    names, each side only when the batch has an example of it): ``kl`` = z0, ``rewards/chosen`` = mean β·ρ over the
    desirable, ``rewards/rejected`` over the undesirable, ``logps/chosen`` / ``logps/rejected`` the policy's mean
    sums, ``rewards/margins`` = rewards/chosen − rewards/rejected when both sides are present.
    """
    if logps.dim() != 1 or logps.numel() == 0:
        raise ValueError(f"logps: expected a 1-D tensor [B] of B >= 1, got shape {tuple(logps.shape)}")
    for name, tensor in (("ref_logps", ref_logps), ("desirable", desirable)):
        if tensor.shape != logps.shape:
            raise ValueError(f"{name}: expected shape {tuple(logps.shape)} like logps, got {tuple(tensor.shape)}")
    if desirable.dtype != torch.bool:
        raise ValueError(f"desirable: expected a bool tensor (the label column), got {desirable.dtype}")
    if not beta > 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not weight > 0:
            raise ValueError(f"{name}: must be > 0, got {weight}")
    z0 = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()
    ratio = logps - ref_logps
    gap = torch.where(desirable, ratio - z0, z0 - ratio)
    weight = torch.where(desirable, desirable_weight, undesirable_weight).to(logps.dtype)
    loss = weight * (1.0 - F.sigmoid(beta * gap))
    with torch.no_grad():
        metrics: dict[str, torch.Tensor] = {"kl": z0}
        rewards = beta * ratio
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            if rows.any():
                metrics[f"rewards/{side}"] = rewards[rows].mean()
                metrics[f"logps/{side}"] = logps[rows].mean()
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics
