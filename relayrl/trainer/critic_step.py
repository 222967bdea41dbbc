"""PPO with a learned critic inside one trainer step (``algorithm.advantage: gae``).

1. ``gae_targets``: the critic's values at the step's starting weights (before any update this step), each rank
   forwarding its rows of every mini-batch, summed over ranks into the whole batch's [B, L-1]; then GAE on every
   rank alike (whitening is batch-wide): token advantages for the policy, returns for the critic.
2. ``CriticUpdate.train``: after the policy's update of a mini-batch, the critic's on the same rows: the clipped
   value loss against those returns and starting values, aggregated with the mini-batch's global token count
   (relayrl/algorithms/value_loss.py: no per-micro-batch normalisation), times ``critic.loss_coef`` and the
   data-parallel size (the gradient reduction averages over ranks), then the critic's own optimizer step.
3. ``CriticUpdate.finish``: metrics reduced over ranks (collective).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from relayrl.algorithms import (
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    masked_mean,
    terminal_rewards,
)
from relayrl.config import AlgorithmConfig, CriticConfig
from relayrl.trainer.batch import TrainBatch


def gae_targets(
    backend, batch: TrainBatch, shards: list[torch.Tensor], mask: torch.Tensor, alg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (advantages, returns, values), each [B, L-1] float32 on the CPU, for the whole batch.
    ``shards``: this rank's rows of each mini-batch (together, every rank's cover the batch once)."""
    values = torch.zeros(mask.shape, dtype=torch.float32, device=backend.device)
    with torch.no_grad():
        for rows in shards:
            values[rows.to(backend.device)] = backend.critic.values(batch.input_ids[rows], batch.attention_mask[rows])
    if backend.dp_size > 1:
        dist.all_reduce(values)
    values = values.cpu()
    rewards = terminal_rewards(batch.rewards, mask)
    advantages, returns = gae_advantages(
        rewards, values, mask, gamma=alg.gamma, lam=alg.lam, whiten=alg.whiten_advantages
    )
    return advantages, returns, values


class CriticUpdate:
    """The critic's share of a step: one update per policy mini-batch, and the step's critic metrics."""

    def __init__(
        self,
        backend,
        batch: TrainBatch,
        mask: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cfg: CriticConfig,
        values_seconds: float,
    ) -> None:
        self.backend, self.batch, self.mask, self.cfg = backend, batch, mask, cfg
        self.advantages, self.returns, self.values = targets
        self.sums = torch.zeros(3, dtype=torch.float64)  # loss shares, clipped tokens, tokens
        self.grad_norms: list[float] = []
        self.values_seconds, self.update_seconds = values_seconds, 0.0

    def train(self, shard: torch.Tensor, minibatch_tokens: float) -> None:
        """Forward rows ``shard`` through the critic, the clipped value loss over a mini-batch of
        ``minibatch_tokens`` loss tokens (all ranks'), backward and step (collective)."""
        began = time.perf_counter()
        device = self.backend.device
        m = self.mask[shard].to(device)
        vpreds = self.backend.critic.values(self.batch.input_ids[shard], self.batch.attention_mask[shard])
        loss, metrics = clipped_value_loss(
            vpreds, self.values[shard].to(device), self.returns[shard].to(device), m,
            cliprange_value=self.cfg.cliprange_value, num_tokens=minibatch_tokens,
        )  # fmt: skip
        (loss * self.cfg.loss_coef * self.backend.dp_size).backward()
        self.grad_norms.append(self.backend.critic.step())
        tokens = float(m.sum())
        self.sums += torch.tensor([float(loss.detach()), float(metrics["value_clip_frac"]) * tokens, tokens])
        self.update_seconds += time.perf_counter() - began

    def finish(self) -> dict[str, float]:
        """Collective: the step's critic metrics. value_loss: the mean over the critic's optimizer steps of each
        mini-batch's loss; explained_variance, values_mean, returns_mean: of the starting values against the
        returns over the batch's loss tokens (before this step's update)."""
        dist.all_reduce(self.sums)
        steps = max(len(self.grad_norms), 1)
        on = self.mask
        return {
            "value_loss": float(self.sums[0]) / steps,
            "value_clip_frac": float(self.sums[1]) / max(float(self.sums[2]), 1.0),
            "critic_grad_norm": sum(self.grad_norms) / steps,
            "explained_variance": float(explained_variance(self.values, self.returns, on)),
            "values_mean": float(masked_mean(self.values.double(), on)),
            "returns_mean": float(masked_mean(self.returns.double(), on)),
            "advantages_mean": float(masked_mean(self.advantages.double(), on)),
            "critic_values_seconds": self.values_seconds,
            "critic_update_seconds": self.update_seconds,
        }
