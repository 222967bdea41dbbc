"""Reward-model losses, by name (TRL's ``RewardTrainer.compute_loss``, OpenRLHF's ``PairWiseLoss``).

Every loss has the signature::

    fn(chosen_rewards [B], rejected_rewards [B], *, margin=None, center_rewards_coefficient=None)
        -> (loss scalar, metrics {name: scalar tensor})

``chosen_rewards[i]`` and ``rejected_rewards[i]`` are the model's scalar scores of pair i's two completions. Metrics
carry TRL's names (``accuracy``, ``margin``, ``min_reward``, ``mean_reward``, ``max_reward``) and are detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from relayrl.registry import Registry

RewardLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
REWARD_LOSSES: Registry[RewardLossFn] = Registry("reward-model loss")


def check_pairs(chosen: torch.Tensor, rejected: torch.Tensor, chosen_name: str, rejected_name: str) -> None:
    """Both 1-D [B] with B >= 1 and of one shape, else a ValueError naming the argument."""
    if chosen.dim() != 1 or chosen.numel() == 0:
        raise ValueError(f"{chosen_name}: expected a 1-D tensor [B] of B >= 1 pairs, got shape {tuple(chosen.shape)}")
    if rejected.shape != chosen.shape:
        raise ValueError(
            f"{rejected_name}: expected shape {tuple(chosen.shape)} like {chosen_name}, got {tuple(rejected.shape)}"
        )


@REWARD_LOSSES.register("bradley_terry")
def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry pairwise loss with an optional margin per pair and TRL's reward centring.

    L = mean_i −log σ(r_c,i − r_r,i − m_i) + c · mean_i (r_c,i + r_r,i)²

    m_i is ``margin[i]`` (0 without a margin: the preference's strength, TRL's ``margin`` column); c is
    ``center_rewards_coefficient`` (None or 0: no centring term; it pulls the scores towards a zero mean,
    Eisenstein et al. 2023). Metrics: accuracy = mean(r_c > r_r), margin = mean(r_c − r_r), and the min, mean and
    max over all 2B scores.
    """
    check_pairs(chosen_rewards, rejected_rewards, "chosen_rewards", "rejected_rewards")
    if margin is not None and margin.shape != chosen_rewards.shape:
        raise ValueError(
            f"margin: expected shape {tuple(chosen_rewards.shape)} (one per pair), got {tuple(margin.shape)}"
        )
    if center_rewards_coefficient is not None and not center_rewards_coefficient >= 0:
        raise ValueError(f"center_rewards_coefficient: must be >= 0, got {center_rewards_coefficient}")
    diff = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(diff if margin is None else diff - margin).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen_rewards + rejected_rewards).square().mean()
    with torch.no_grad():
        scores = torch.cat([chosen_rewards, rejected_rewards])
        metrics = {
            "accuracy": (diff > 0).float().mean(),
            "margin": diff.mean(),
            "min_reward": scores.min(),
            "mean_reward": scores.mean(),
            "max_reward": scores.max(),
        }
    return loss, metrics
