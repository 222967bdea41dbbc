"""Paired preference losses on sequence log-probs, by name (TRL's ``DPOTrainer`` loss types).

Every loss has the signature::

    fn(chosen_logps [B], rejected_logps [B], ref_chosen_logps [B], ref_rejected_logps [B], *, beta,
       label_smoothing=0.0, chosen_tokens=None, rejected_tokens=None) -> (loss per pair [B], metrics)

The log-probs are ``sequence_logprobs``: a completion's token log-probs summed over its completion tokens, under
the policy and under the frozen reference. The batch loss is the mean of the per-pair losses (a data-parallel caller
sums them and divides by the global pair count). With the log-ratios ρ_c = chosen − ref_chosen and
ρ_r = rejected − ref_rejected, the implicit rewards are β·ρ, and the metrics carry TRL's names: ``rewards/chosen``
= mean β·ρ_c, ``rewards/rejected`` = mean β·ρ_r, ``rewards/accuracies`` = mean(β·ρ_c > β·ρ_r),
``rewards/margins`` = mean β·(ρ_c − ρ_r), ``logps/chosen`` and ``logps/rejected`` = the policy's mean sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from relayrl.algorithms.aggregation import masked_sum
from relayrl.algorithms.reward_loss import check_pairs
from relayrl.registry import Registry

PreferenceLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")


def sequence_logprobs(logprob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π(completion | prompt) = Σ_t mask_t · logprob_t per row: [B, T] -> [B].

    ``mask`` is 1 on the positions that score a completion token and 0 elsewhere (prompt, padding, the positions of
    another packed example); a masked position never counts, whatever ``logprob`` holds there (NaN included)."""
    if logprob.dim() != 2:
        raise ValueError(f"logprob: expected a 2-D tensor [B, T], got shape {tuple(logprob.shape)}")
    if mask.shape != logprob.shape:
        raise ValueError(f"mask: expected shape {tuple(logprob.shape)} like logprob, got {tuple(mask.shape)}")
    return masked_sum(logprob, mask, dim=-1)


def preference_metrics(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """TRL's DPO metrics from the policy's sequence log-probs and the implicit rewards β·ρ (module docstring)."""
    with torch.no_grad():
        return {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.mean(),
            "logps/rejected": rejected_logps.mean(),
        }


def _log_ratios(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_pairs(chosen_logps, rejected_logps, "chosen_logps", "rejected_logps")
    check_pairs(chosen_logps, ref_chosen_logps, "chosen_logps", "ref_chosen_logps")
    check_pairs(chosen_logps, ref_rejected_logps, "chosen_logps", "ref_rejected_logps")
    if not beta > 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    return chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps


@PREFERENCE_LOSSES.register("sigmoid")
def dpo_sigmoid_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023), and conservative DPO (cDPO, Mitchell 2023) with ``label_smoothing`` ε > 0.

    Δ = ρ_c − ρ_r
    loss = −(1 − ε) · log σ(β·Δ) − ε · log σ(−β·Δ)

    ε is the probability that a pair's label is flipped (cDPO's eq. 3, as OpenRLHF's ``DPOLoss`` and TRL's 0.x
    ``sigmoid`` loss with ``label_smoothing`` compute it; TRL 1.x reads ``label_smoothing`` only in its ``robust``
    and ``exo_pair`` losses); ε = 0 is plain DPO. The token counts are accepted for a uniform
    signature and not read.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: conservative DPO needs 0 <= ε < 0.5, got {label_smoothing}")
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    logits = beta * (chosen_ratio - rejected_ratio)
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    metrics = preference_metrics(chosen_logps, rejected_logps, beta * chosen_ratio, beta * rejected_ratio)
    return loss, metrics


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO (Azar et al. 2023, eq. 17, β in the role of τ) on length-normalised log-ratios, as TRL computes it.

    h    = ρ_c / n_c − ρ_r / n_r          (n: the completion's token count, at least 1)
    loss = (h − 1 / (2β))²

    ``chosen_tokens`` / ``rejected_tokens`` [B] are n_c, n_r (the mask sums of ``sequence_logprobs``): TRL divides
    by them, which the IPO authors confirmed matches the paper's results. The metrics' rewards stay β·ρ (the sums),
    as TRL logs them. ``label_smoothing`` must be 0 (IPO has none).
    """
    if label_smoothing:
        raise ValueError(f"label_smoothing: ipo has no label smoothing (use sigmoid), got {label_smoothing}")
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    counts = []
    for name, tokens in (("chosen_tokens", chosen_tokens), ("rejected_tokens", rejected_tokens)):
        if tokens is None:
            raise ValueError(f"{name}: ipo normalises each log-ratio by its completion's token count; pass it")
        if tokens.shape != chosen_logps.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(chosen_logps.shape)} like chosen_logps, got {tuple(tokens.shape)}"
            )
        counts.append(tokens.to(chosen_ratio.dtype).clamp(min=1.0))
    h = chosen_ratio / counts[0] - rejected_ratio / counts[1]
    loss = (h - 1.0 / (2.0 * beta)).square()
    metrics = preference_metrics(chosen_logps, rejected_logps, beta * chosen_ratio, beta * rejected_ratio)
    return loss, metrics


def compute_preference_loss(
    name: str,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    **kwargs: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Look up the loss ``name`` in PREFERENCE_LOSSES and apply it (keyword options pass through)."""
    fn = PREFERENCE_LOSSES.get(name)
    return fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, **kwargs)
