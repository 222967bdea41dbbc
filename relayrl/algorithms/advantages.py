"""Sequence-level advantage estimators for outcome rewards (one scalar reward per response).

Every estimator has the signature::

    fn(rewards: Tensor[B] float, group_ids: Tensor[B] int64, *, eps=1e-6, norm_by_std=True) -> Tensor[B]

``group_ids[i]`` names the prompt group of response ``i`` (ids need not be contiguous or sorted). The
result is one advantage per response; the trainer broadcasts it over that response's tokens. Statistics
are computed in float64 and the result has the dtype of ``rewards`` (float32 for integer rewards).

``gae`` (relayrl/algorithms/gae.py) is registered here too, with its own signature: it takes token rewards
and the critic's values, and the trainer calls it with them (``compute_advantages`` refuses it); so is ``distill``
(relayrl/algorithms/distill.py: the teacher's log-probs of the sampled tokens).

A group of two or more responses whose rewards are all equal carries no signal: ``grpo``, ``rloo`` and
``reinforce_pp_baseline`` give it exactly 0 (not a rounding residue).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relayrl.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@dataclass
class _GroupStats:
    """Per-response views of per-group statistics (all float64, shape [B])."""

    count: torch.Tensor  # group size n_g
    mean: torch.Tensor  # group mean
    std: torch.Tensor  # unbiased group std (0 for singletons)
    constant: torch.Tensor  # bool: group has >= 2 members and all rewards equal


def _check(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids: expected shape {tuple(rewards.shape)} like rewards, got {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got {group_ids.dtype}")
    if not torch.isfinite(rewards.double()).all():
        raise ValueError("rewards: contains NaN or infinity")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.dtype.is_floating_point else torch.float32


def _group_stats(r: torch.Tensor, group_ids: torch.Tensor) -> _GroupStats:
    """Group size, mean, unbiased std and constant-ness, gathered back to each response."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max().item()) + 1
    zeros = torch.zeros(g, dtype=r.dtype, device=r.device)
    count = torch.bincount(inv, minlength=g).to(r.dtype)
    mean = zeros.clone().index_add_(0, inv, r) / count
    sq = zeros.clone().index_add_(0, inv, (r - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    gmax = zeros.clone().scatter_reduce_(0, inv, r, reduce="amax", include_self=False)
    gmin = zeros.clone().scatter_reduce_(0, inv, r, reduce="amin", include_self=False)
    constant = (gmax == gmin) & (count >= 2)
    return _GroupStats(count=count[inv], mean=mean[inv], std=std[inv], constant=constant[inv])


def _batch_std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the whole batch; 1 for a batch of one (nothing to whiten against)."""
    return x.std() if x.numel() >= 2 else torch.ones((), dtype=x.dtype, device=x.device)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantage(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """GRPO (Shao et al. 2024), as verl's ``compute_grpo_outcome_advantage``.

    A_i = (r_i - mean_g) / (std_g + eps)      (norm_by_std=True; std_g unbiased, like torch.std)
    A_i = r_i - mean_g                        (norm_by_std=False: Dr.GRPO, Liu et al. 2025)

    A singleton group uses mean_g = 0 and std_g = 1 (as verl), so A_i = r_i / (1 + eps).
    A group (size >= 2) of identical rewards gives exactly 0.
    """
    _check(rewards, group_ids, eps)
    if rewards.numel() == 0:
        return torch.zeros_like(rewards, dtype=_out_dtype(rewards))
    r = rewards.double()
    st = _group_stats(r, group_ids)
    single = st.count == 1
    mean = torch.where(single, torch.zeros_like(r), st.mean)
    std = torch.where(single, torch.ones_like(r), st.std)
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(st.constant, torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(rewards))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantage(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline within the group.

    A_i = r_i - mean_{j != i} r_j = n/(n-1) · (r_i - mean_g)

    A singleton group has no baseline and gets 0. ``eps`` and ``norm_by_std`` are accepted for a
    uniform signature and ignored (RLOO is not std-normalised).
    """
    _check(rewards, group_ids, eps)
    if rewards.numel() == 0:
        return torch.zeros_like(rewards, dtype=_out_dtype(rewards))
    r = rewards.double()
    st = _group_stats(r, group_ids)
    n = st.count
    adv = n / (n - 1).clamp(min=1) * (r - st.mean)
    adv = torch.where((n < 2) | st.constant, torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(rewards))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantage(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) with an outcome reward and gamma = 1: whiten over the whole batch.

    A_i = (r_i - mean_B) / (std_B + eps)      (std_B unbiased; norm_by_std=False: A_i = r_i - mean_B)

    ``group_ids`` is ignored. A batch whose rewards are all equal (or of size 1) gives exactly 0.
    """
    _check(rewards, group_ids, eps)
    if rewards.numel() == 0:
        return torch.zeros_like(rewards, dtype=_out_dtype(rewards))
    r = rewards.double()
    adv = r - r.mean()
    if norm_by_std:
        adv = adv / (_batch_std(r) + eps)
    if bool((r == r[0]).all()):
        adv = torch.zeros_like(adv)
    return adv.to(_out_dtype(rewards))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """REINFORCE++-baseline (verl): subtract the group mean, then whiten over the batch.

    x_i = r_i - mean_g                         (singleton group: mean_g = 0, as verl)
    A_i = (x_i - mean_B(x)) / (std_B(x) + eps) (norm_by_std=False: A_i = x_i - mean_B(x))

    A group (size >= 2) of identical rewards is set to exactly 0: its x is 0, and so is mean_B(x) in exact
    arithmetic whenever every group has two or more members, so this only removes a rounding residue.
    """
    _check(rewards, group_ids, eps)
    if rewards.numel() == 0:
        return torch.zeros_like(rewards, dtype=_out_dtype(rewards))
    r = rewards.double()
    st = _group_stats(r, group_ids)
    mean = torch.where(st.count == 1, torch.zeros_like(r), st.mean)
    x = torch.where(st.constant, torch.zeros_like(r), r - mean)
    adv = x - x.mean()
    if norm_by_std:
        adv = adv / (_batch_std(x) + eps)
    adv = torch.where(st.constant, torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(rewards))


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Look up the estimator ``name`` in ADVANTAGE_ESTIMATORS and apply it (an outcome-reward estimator: not gae)."""
    if name == "gae":
        raise ValueError("advantage: gae needs the critic's values: call gae.gae_advantages, not compute_advantages")
    if name == "distill":
        raise ValueError("advantage: distill needs the teacher's log-probs: call distill.distill_advantage")
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, group_ids, eps=eps, norm_by_std=norm_by_std)
