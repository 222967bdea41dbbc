"""Per-token KL(π_θ || π_ref) estimators from sampled log-probabilities (Schulman, "Approximating KL
Divergence", 2020), by name. All are elementwise: ``fn(logprob, ref_logprob) -> Tensor`` of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def _check(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> None:
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"ref_logprob: expected shape {tuple(logprob.shape)} like logprob, got {tuple(ref_logprob.shape)}"
        )


@KL_ESTIMATORS.register("k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = lp - ref (unbiased, high variance, can be negative)."""
    _check(logprob, ref_logprob)
    return logprob - ref_logprob


@KL_ESTIMATORS.register("k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (lp - ref)² (biased, low variance, >= 0)."""
    _check(logprob, ref_logprob)
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10] (unbiased, low variance, >= 0).

    As verl's ``low_var_kl``, ref - lp is first clamped to [-20, 20] so exp cannot overflow.
    """
    _check(logprob, ref_logprob)
    d = torch.clamp(ref_logprob - logprob, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate of kind ``kind`` (k1, k2 or k3); KeyError naming an unknown kind."""
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)
