"""Per-token policy-gradient losses, by name (as verl's ``compute_policy_loss``).

Every loss has the signature::

    fn(logprob, old_logprob, advantages, mask, *, clip_low=0.2, clip_high=0.28, clip_c=3.0, is_weights=None)
        -> (loss_mat [B, T], metrics {name: scalar tensor})

The loss matrix is *not* aggregated (see ``aggregation.agg_loss``); positions where ``mask`` is 0 may hold
anything. Metrics are detached masked means over the valid tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.algorithms.aggregation import masked_mean
from relayrl.config import GSPO_CLIP
from relayrl.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0
# losses whose every token's loss is its advantage times a finite function of the logprobs (PPO's clipped ratio,
# with the dual clip; GSPO's clipped sequence ratio): a token of zero advantage has zero loss and zero gradient
ADVANTAGE_LINEAR_LOSSES = frozenset({"ppo_clip", "gspo"})


def _check_shapes(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D tensor [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like mask, got {tuple(t.shape)}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with DAPO clip-higher and dual-clip, per token.

    ratio = exp(clamp(logprob - old_logprob, -20, 20))
    pg1   = -A · ratio
    pg2   = -A · clip(ratio, 1 - clip_low, 1 + clip_high)        (clip-higher: clip_high > clip_low)
    loss  = max(pg1, pg2)
    loss  = min(loss, -A · clip_c)   where A < 0                 (dual-clip, Ye et al. 2020; clip_c > 1)
    loss  = loss · is_weights                                    (truncated IS weights, detached)

    All inputs are [B, T]; ``advantages`` is already broadcast over tokens. ``clip_c=None`` disables
    dual-clip. Metrics: clip_frac (pg2 > pg1), clip_frac_low (clipped at 1 - clip_low, A < 0),
    clip_frac_high (clipped at 1 + clip_high, A > 0), dual_clip_frac, approx_kl = mean(old - new).
    """
    _check_shapes(mask, logprob=logprob, old_logprob=old_logprob, advantages=advantages, is_weights=is_weights)
    if not clip_low >= 0:
        raise ValueError(f"clip_low: must be >= 0, got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high: must be >= 0, got {clip_high}")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c: the dual-clip bound must be > 1, got {clip_c} (pass None to disable dual-clip)")

    log_ratio = torch.clamp(logprob - old_logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1

    neg = advantages < 0
    if clip_c is not None:
        pg3 = -advantages * clip_c
        dual = neg & (loss > pg3)
        loss = torch.where(neg, torch.minimum(loss, pg3), loss)
    else:
        dual = torch.zeros_like(clipped)

    if is_weights is not None:
        loss = loss * is_weights.detach()

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "clip_frac_low": masked_mean((clipped & neg).float(), mask),
            "clip_frac_high": masked_mean((clipped & (advantages > 0)).float(), mask),
            "dual_clip_frac": masked_mean(dual.float(), mask),
            "approx_kl": masked_mean(-log_ratio.float(), mask),
        }
    return loss, metrics


SEQ_LOG_RATIO_MAX = 10.0


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = GSPO_CLIP[0],
    clip_high: float = GSPO_CLIP[1],
    clip_c: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the PPO clip on a sequence-level ratio, in its GSPO-token form.

    log s_i   = Σ_t mask · (logprob − old_logprob) / Σ_t mask      (s_i: geometric mean of row i's token ratios)
    log s_i,t = sg[log s_i] + logprob_t − sg[logprob_t]            (= log s_i in value; gradient ∇ log π_t)
    s_i,t     = exp(min(log s_i,t, 10))
    pg1 = −A · s_i,t,  pg2 = −A · clip(s_i,t, 1 − clip_low, 1 + clip_high),  loss = max(pg1, pg2)
    loss = loss · is_weights                                     (truncated IS weights per token, detached)

    sg is stop-gradient. With a sequence-level advantage (constant over the row) and ``seq-mean-token-mean``
    aggregation this is GSPO's sequence objective: every token of a row is clipped together, and the row's
    gradient is s_i · A_i · mean_t ∇ log π_t. ``clip_c`` is accepted for a uniform signature and ignored (GSPO has
    no dual-clip). The default clip range, 3e-4 / 4e-4, is verl's examples/gspo_trainer's: a geometric mean of
    token ratios strays from 1 far less than one token's ratio. Metrics as ``ppo_clip_loss`` (clip_frac and its
    sides, approx_kl = mean(old − new) per token; dual_clip_frac 0).
    """
    _check_shapes(mask, logprob=logprob, old_logprob=old_logprob, advantages=advantages, is_weights=is_weights)
    if not clip_low >= 0:
        raise ValueError(f"clip_low: must be >= 0, got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high: must be >= 0, got {clip_high}")

    log_ratio = logprob - old_logprob
    valid = mask != 0
    tokens = mask.sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(valid, log_ratio * mask, torch.zeros_like(log_ratio)).sum(-1) / tokens
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprob - logprob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=SEQ_LOG_RATIO_MAX))
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if is_weights is not None:
        loss = loss * is_weights.detach()

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "clip_frac_low": masked_mean((clipped & (advantages < 0)).float(), mask),
            "clip_frac_high": masked_mean((clipped & (advantages > 0)).float(), mask),
            "dual_clip_frac": torch.zeros((), device=mask.device),
            "approx_kl": masked_mean(-log_ratio.float(), mask),
        }
    return loss, metrics


def compute_policy_loss(
    name: str,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Look up the loss ``name`` in POLICY_LOSSES and apply it (keyword options pass through)."""
    return POLICY_LOSSES.get(name)(logprob, old_logprob, advantages, mask, **kwargs)
