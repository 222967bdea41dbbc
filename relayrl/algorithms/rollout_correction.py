"""Rollout correction: the engine that sampled a response is not the trainer that scores it.

Per response token t of row i (loss mask m_it; tokens with m = 0 never count anywhere):

    δ_it = log π_trainer(y_it) − log π_behaviour(y_it),        ρ_it = exp(clamp(δ_it, −20, 20))

π_behaviour is the engine's per-token log-prob as sampled (each token its own, so a response generated across an
in-flight weight update is corrected token by token); π_trainer is the trainer's at the step's starting weights.

- Importance weights (``importance_weights``; levels in IS_LEVELS, verl's ``rollout_is``, TRL's
  ``vllm_importance_sampling_mode``): log w_i(t) = δ_it (token), Σ_t m δ_it (sequence: the product of ratios) or
  Σ_t m δ_it / Σ_t m (geometric: their geometric mean); then truncated (TIS: w ← clamp(w, lower, upper)) or
  masked (MIS: tokens with w ∉ [lower, upper] are dropped), optionally normalised to mean 1 over the kept tokens
  (sequences for the sequence levels). IcePop (``icepop``) is the token level, masked, with both bounds.
- Rejection (``rejection_keep``; verl's ``rollout_rs``): a criterion ``<level>_<k>`` reduces a per-token
  divergence of KL(π_behaviour ‖ π_trainer) over each row — level token, seq_sum, seq_mean or seq_max (max_t) —
  and keeps a token (or a whole row) only where the statistic holds its thresholds. k1 is signed, so its bounds
  are on the ratio it implies, lower ≤ exp(−stat) ≤ upper (token_k1: ρ_it; seq_sum_k1: Π_t ρ_it; seq_mean_k1: the
  geometric mean, verl's "Geo-RS"); k2 = ½ δ² and k3 = ρ − 1 − δ are ≥ 0 and 0 on-policy, so they take an upper
  bound only. seq_max_k1 is not offered: the max of a signed divergence bounds one side only (token_k1 bounds
  every token on both).
- The denominator: a dropped or rejected token leaves the loss mask (``Correction.keep``), so token-mean counts the
  kept tokens only, and a row whose every token is rejected contributes nothing (seq-mean-token-mean counts rows
  with a kept token).
- Diagnostics (``diagnostic_sums`` / ``diagnostic_metrics``) measure the mismatch itself; see their docstrings.

References: verl ``verl/trainer/ppo/rollout_corr_helper.py`` (Liu, Li et al. 2025, "When Speed Kills Stability"),
TRL ``GRPOConfig.vllm_importance_sampling_mode``, IcePop (Ling team, Ring-1T, 2025).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from relayrl.algorithms.aggregation import masked_sum
from relayrl.algorithms.kl import kl_penalty
from relayrl.config import RS_CRITERIA, Bounds, RolloutCorrectionConfig
from relayrl.registry import Registry

SAFETY_BOUND = 20.0  # |log w| is clamped here before exp (verl's SAFETY_BOUND): exp(20) ≈ 4.9e8

TIS_BOUNDS = Bounds(2.0)  # verl's and TRL's default cap
# a per-token value [B, T] and the loss mask -> the value of its level, broadcast over the row: the IS levels reduce
# the log-ratio δ (token: δ_it; sequence: Σ_t m δ_it, the likelihood ratio; geometric: its mean over the row's
# tokens), the rejection levels a divergence (token, seq_sum, seq_mean, seq_max): one set of functions serves both
ReduceFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IS_LEVELS: Registry[ReduceFn] = Registry("rollout IS level")
RS_LEVELS: Registry[ReduceFn] = Registry("rollout rejection level")


def _row_tokens(mask: torch.Tensor) -> torch.Tensor:
    return (mask != 0).sum(-1, keepdim=True)


@IS_LEVELS.register("token")
@RS_LEVELS.register("token")
def token_stat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The token's own value."""
    return values


@IS_LEVELS.register("sequence")
@RS_LEVELS.register("seq_sum")
def seq_sum_stat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t m v_it, broadcast over the row."""
    return masked_sum(values, mask, dim=-1).unsqueeze(-1).expand_as(values)


@IS_LEVELS.register("geometric")
@RS_LEVELS.register("seq_mean")
def seq_mean_stat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t m v_it / Σ_t m, broadcast over the row (0 for an empty row)."""
    return seq_sum_stat(values, mask) / _row_tokens(mask).clamp(min=1)


@RS_LEVELS.register("seq_max")
def seq_max_stat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max_t over the row's tokens with m ≠ 0, broadcast over the row (0 for an empty row)."""
    worst = torch.where(mask != 0, values, torch.full_like(values, -math.inf)).amax(-1, keepdim=True)
    return torch.where(torch.isinf(worst), torch.zeros_like(worst), worst).expand_as(values)


def log_ratio_of(trainer_logprob: torch.Tensor, behaviour_logprob: torch.Tensor) -> torch.Tensor:
    """δ = log π_trainer − log π_behaviour, float32."""
    if trainer_logprob.shape != behaviour_logprob.shape:
        raise ValueError(
            f"behaviour_logprob: expected shape {tuple(trainer_logprob.shape)}, got {tuple(behaviour_logprob.shape)}"
        )
    return trainer_logprob.float() - behaviour_logprob.float()


@dataclass(frozen=True)
class Correction:
    """``weights``: the detached IS weights (1 where IS is off), 0 where not kept; ``keep``: the loss mask's
    tokens that stay (bool), the loss mask the loss and its denominator use."""

    weights: torch.Tensor
    keep: torch.Tensor


def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    bounds: Bounds = TIS_BOUNDS,
    mode: str = "truncate",
) -> Correction:
    """IS weights of ``level`` (IS_LEVELS), truncated or masked (module docstring):

    truncate: w = clamp(exp(log w), lower or 0, upper), every token kept;
    mask:     keep = lower ≤ exp(log w) ≤ upper (lower None: no lower bound), w = exp(log w) on kept tokens.
    """
    log_w = torch.clamp(IS_LEVELS.get(level)(log_ratio, mask), -SAFETY_BOUND, SAFETY_BOUND)
    raw = torch.exp(log_w)
    valid = mask != 0
    if mode == "truncate":
        weights, keep = raw.clamp(min=bounds.lower or 0.0, max=bounds.upper), valid
    elif mode == "mask":
        inside = raw <= bounds.upper if bounds.lower is None else (raw >= bounds.lower) & (raw <= bounds.upper)
        weights, keep = raw, valid & inside
    else:
        raise ValueError(f"mode: 'truncate' or 'mask', not {mode!r}")
    return Correction(weights=torch.where(keep, weights, torch.zeros_like(weights)).detach(), keep=keep)


def weight_sums(correction: Correction, level: str) -> torch.Tensor:
    """(Σ w, count) over the kept tokens (token level) or the rows with a kept token (sequence levels: one weight
    per row), float64: added over ranks, Σ w / count is the batch mean ``normalised`` divides by."""
    if level == "token":
        return torch.stack([correction.weights.double().sum(), correction.keep.double().sum()])
    rows = correction.keep.any(-1)
    per_row = correction.weights.double().amax(-1)  # the row's one weight (0 when the row keeps nothing)
    return torch.stack([per_row[rows].sum(), rows.double().sum()])


def normalised(correction: Correction, sums: torch.Tensor) -> Correction:
    """Batch normalisation: w / (Σ w / count) from ``weight_sums`` (added over ranks); unchanged when Σ w is 0."""
    mean = float(sums[0]) / max(float(sums[1]), 1.0)
    if mean <= 0:
        return correction
    return Correction(weights=correction.weights / mean, keep=correction.keep)


def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, lower: float = 0.5, upper: float = 5.0) -> Correction:
    """IcePop: token ratios ρ_it kept inside [lower, upper] as weights, the tokens outside dropped (verl's
    ``decoupled_token_icepop`` bounds 0.5 and 5)."""
    return importance_weights(log_ratio, mask, level="token", bounds=Bounds(upper, lower), mode="mask")


def rejection_keep(
    trainer_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    mask: torch.Tensor,
    criteria: Sequence[tuple[str, Bounds]],
) -> torch.Tensor:
    """The tokens every criterion keeps (bool [B, T], within ``mask``); see the module docstring.

    Per token: k1 = log π_b − log π_t, k2 = ½ (log π_b − log π_t)², k3 = ρ − 1 − log ρ (relayrl.algorithms.kl with
    the behaviour policy as the sampler). k1 criteria keep lower ≤ exp(−stat) ≤ upper (lower None: 1/upper, as
    verl); k2/k3 keep stat ≤ upper.
    """
    keep = mask != 0
    for name, bounds in criteria:
        level, k = name.rsplit("_", 1)
        if name not in RS_CRITERIA:
            raise KeyError(f"unknown rejection criterion {name!r}; known: {', '.join(RS_CRITERIA)}")
        per_token = kl_penalty(behaviour_logprob.float(), trainer_logprob.float(), k)
        stat = RS_LEVELS.get(level)(per_token, mask)
        if k == "k1":
            lower = bounds.lower if bounds.lower is not None else 1.0 / bounds.upper
            log_ratio = -stat
            keep = keep & (log_ratio >= math.log(lower)) & (log_ratio <= math.log(bounds.upper))
        else:
            keep = keep & (stat <= bounds.upper)
    return keep


def reject(correction: Correction, keep: torch.Tensor) -> Correction:
    """``correction`` with the tokens outside ``keep`` dropped too."""
    both = correction.keep & keep
    return Correction(weights=torch.where(both, correction.weights, torch.zeros_like(correction.weights)), keep=both)


def apply_correction(
    cfg: RolloutCorrectionConfig,
    *,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    trainer: torch.Tensor,
    mask: torch.Tensor,
) -> Correction:
    """The correction ``cfg`` asks for on these rows: IS weights from log(π_proximal / π_behaviour) (1 where
    ``cfg.rollout_is`` is null), then the rejection criteria on log(π_trainer / π_behaviour). In decoupled mode
    ``proximal`` and ``trainer`` are both the trainer's old log-probs; where the old log-probs are the engine's
    (bypass), ``proximal`` is the engine's (weights 1: the PPO ratio already is π_θ / π_behaviour) and ``trainer``
    the current forward's, detached."""
    valid = mask != 0
    if cfg.rollout_is is None:
        correction = Correction(weights=valid.float(), keep=valid)
    else:
        correction = importance_weights(
            log_ratio_of(proximal, behaviour), mask, level=cfg.rollout_is, bounds=cfg.is_bounds,
            mode=cfg.rollout_is_mode,
        )  # fmt: skip
    criteria = cfg.criteria()
    return reject(correction, rejection_keep(trainer, behaviour, mask, criteria)) if criteria else correction


# Diagnostics: sums over tokens or rows (so shards and mini-batches add up; *_max / *_min reduce by max / min).
DIAGNOSTIC_SUMS = ("tokens", "rows", "k1", "k3", "ratio", "ratio_sq", "seq_ratio_sq", "log_ppl_diff")
APPLIED_SUMS = ("tokens", "rows", "kept_tokens", "rejected_rows", "weight")


def diagnostic_sums(
    trainer_logprob: torch.Tensor, behaviour_logprob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums of the mismatch on these rows (float64, detached), for ``diagnostic_metrics``; rows with no token
    count nowhere."""
    with torch.no_grad():
        delta = log_ratio_of(trainer_logprob, behaviour_logprob).double()
        valid = mask != 0
        rows = valid.any(-1)
        ratio = torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        seq_delta = masked_sum(delta, valid, dim=-1)
        row_mean = seq_delta / valid.sum(-1).clamp(min=1)
        zero = torch.zeros((), dtype=torch.float64, device=delta.device)
        return {
            "tokens": valid.sum().double(),
            "rows": rows.sum().double(),
            "k1": masked_sum(-delta, valid),
            "k3": masked_sum(kl_penalty(behaviour_logprob.double(), trainer_logprob.double(), "k3"), valid),
            "ratio": masked_sum(ratio, valid),
            "ratio_sq": masked_sum(ratio.square(), valid),
            "seq_ratio_sq": torch.where(rows, torch.exp(2 * seq_delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)), zero).sum(),
            "log_ppl_diff": torch.where(rows, -row_mean, zero).sum(),
            "ratio_max": torch.where(valid, ratio, -math.inf).max() if bool(valid.any()) else zero,
            "ratio_min": torch.where(valid, ratio, math.inf).min() if bool(valid.any()) else zero,
        }


def applied_sums(correction: Correction, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums of what a correction did on these rows: kept tokens, rows left with no kept token, Σ w (kept), and
    the weight's max and min over the kept tokens."""
    with torch.no_grad():
        valid = mask != 0
        rows = valid.any(-1)
        kept = correction.keep & valid
        w = correction.weights.double()
        any_kept = bool(kept.any())
        zero = torch.zeros((), dtype=torch.float64, device=w.device)
        return {
            "tokens": valid.sum().double(),
            "rows": rows.sum().double(),
            "kept_tokens": kept.sum().double(),
            "rejected_rows": (rows & ~kept.any(-1)).sum().double(),
            "weight": torch.where(kept, w, zero).sum(),
            "weight_max": torch.where(kept, w, -math.inf).max() if any_kept else zero,
            "weight_min": torch.where(kept, w, math.inf).min() if any_kept else zero,
        }


def diagnostic_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The mismatch KL(π_behaviour ‖ π_trainer) and its kin, from ``diagnostic_sums`` (added over shards), per
    token n over N tokens and row i over R rows:

    kl_k1 = Σ −δ / N;  kl_k3 = Σ (ρ − 1 − δ) / N;  chi2_token = Σ ρ² / N − 1;  chi2_seq = Σ_i (Π_t ρ_it)² / R − 1;
    log_ppl_diff = Σ_i (mean_t log π_b − mean_t log π_t) / R  (log-PPL of the trainer minus the engine's);
    ess = (Σ ρ)² / (N Σ ρ²) ∈ (0, 1]  (effective sample size of token IS, as a share of N; 1 on-policy);
    ratio_mean = Σ ρ / N, ratio_max, ratio_min.
    """
    n, r = max(sums["tokens"], 1.0), max(sums["rows"], 1.0)
    return {
        "kl_k1": sums["k1"] / n,
        "kl_k3": sums["k3"] / n,
        "chi2_token": sums["ratio_sq"] / n - 1.0 if sums["tokens"] else 0.0,
        "chi2_seq": sums["seq_ratio_sq"] / r - 1.0 if sums["rows"] else 0.0,
        "log_ppl_diff": sums["log_ppl_diff"] / r,
        "ess": sums["ratio"] ** 2 / (n * sums["ratio_sq"]) if sums["ratio_sq"] else 1.0,
        "ratio_mean": sums["ratio"] / n if sums["tokens"] else 1.0,
        "ratio_max": sums["ratio_max"],
        "ratio_min": sums["ratio_min"],
    }


def applied_metrics(sums: dict[str, float]) -> dict[str, float]:
    """From ``applied_sums``: rejected_token_share = 1 − kept / N; rejected_seq_share = rows with no kept token /
    R; is_weight_mean = Σ w / kept, is_weight_max, is_weight_min (over kept tokens)."""
    return {
        "rejected_token_share": 1.0 - sums["kept_tokens"] / sums["tokens"] if sums["tokens"] else 0.0,
        "rejected_seq_share": sums["rejected_rows"] / sums["rows"] if sums["rows"] else 0.0,
        "is_weight_mean": sums["weight"] / sums["kept_tokens"] if sums["kept_tokens"] else 0.0,
        "is_weight_max": sums["weight_max"],
        "is_weight_min": sums["weight_min"],
    }


def rollout_diagnostics(
    trainer_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction | None = None,
) -> dict[str, float]:
    """One batch's diagnostics: ``diagnostic_metrics`` and, given the correction applied, ``applied_metrics``."""
    out = diagnostic_metrics(
        {k: float(v) for k, v in diagnostic_sums(trainer_logprob, behaviour_logprob, mask).items()}
    )
    if correction is not None:
        out |= applied_metrics({k: float(v) for k, v in applied_sums(correction, mask).items()})
    return out
