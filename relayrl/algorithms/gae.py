"""Generalised advantage estimation (Schulman et al. 2016) per token, for PPO with a learned critic.

Tensors are [B, T] over a row's positions (``TrainBatch``: position t scores token t+1). ``mask`` is 1 on the
tokens the policy sampled and 0 elsewhere: the prompt, padding, and in an agentic episode the observation and
template tokens between the policy's turns. A masked position is not a step of the MDP: GAE skips it, carrying
the next value and the running advantage across it, so an episode's policy turns chain into one trajectory (as
verl's ``compute_gae_advantage_return`` skips observation tokens in multi-turn).
"""

from __future__ import annotations

import torch

from relayrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from relayrl.algorithms.aggregation import masked_mean


def _check(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D tensor [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like mask, got {tuple(t.shape)}")


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An outcome reward as a token-level one: r_{i,t} = rewards_i at row i's last policy token, 0 elsewhere.

    A row with no policy token gets no reward (all zeros)."""
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards: expected shape [{mask.shape[0]}] (one per row of mask), got {tuple(rewards.shape)}")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask != 0, positions, -1).amax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards[rows].double()
    return out.to(rewards.dtype if rewards.dtype.is_floating_point else torch.float32)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions (var unbiased, as verl's ``masked_whiten``);
    0 where ``mask`` is 0. Fewer than two masked positions: x - mean (nothing to scale by)."""
    m = mask.double()
    xd = x.double()
    mean = masked_mean(xd, m)
    n = m.sum()
    centred = xd - mean
    if n < 2:
        return (centred * m).to(x.dtype)
    var = masked_mean(centred**2, m) * n / (n - 1)
    return (centred * torch.rsqrt(var + eps) * m).to(x.dtype)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(γ, λ) advantages and returns per token; returns (advantages, returns), both [B, T], 0 where mask is 0.

    Over row i's policy tokens t_1 < t_2 < … < t_n (masked positions skipped; V after the last is 0):

        δ_k = r_{t_k} + γ · V(t_{k+1}) − V(t_k)
        A_k = δ_k + γ · λ · A_{k+1}                 (A_{n+1} = 0)
        R_k = A_k + V(t_k)                         (the value target, before whitening)
        A   = masked_whiten(A)                     (whiten=True: zero mean, unit variance over the batch's tokens)

    With γ = λ = 1 and a terminal reward R, A_k = R − V(t_k) (Monte-Carlo: no bootstrap from the critic).
    ``token_rewards`` may be float32; the recursion runs in float64 and the results take ``values``' dtype.
    """
    _check(mask, token_rewards=token_rewards, values=values)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: must be in [0, 1], got {lam}")
    m = (mask != 0).double()
    r, v = token_rewards.double() * m, values.double() * m
    next_value = torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device)
    running = torch.zeros_like(next_value)
    adv = torch.zeros_like(v)
    for t in reversed(range(mask.shape[1])):
        on = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        running = torch.where(on != 0, step, running)  # a masked position leaves the recursion as it was
        next_value = torch.where(on != 0, v[:, t], next_value)
        adv[:, t] = running * on
    returns = (adv + v) * m
    if whiten:
        adv = masked_whiten(adv, m)
    dtype = values.dtype if values.dtype.is_floating_point else torch.float32
    return adv.to(dtype), returns.to(dtype)
