"""One trainer step on a rollout batch: advantages, old logprobs, mini-batch PPO updates.

Every rank holds the whole batch (so global token and sequence counts are known locally) and
trains on rows ``rank::world`` of each mini-batch. Gradient reduction averages over ranks, so the
local loss is multiplied by the world size: the result is the loss of the whole mini-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relayrl.config import AlgorithmConfig, TrainerConfig
from relayrl.trainer.algorithms import agg_loss, compute_advantages, compute_policy_loss, kl_penalty
from relayrl.trainer.batch import TrainBatch

METRIC_SUMS = ("clip_frac", "dual_clip_frac", "ppo_kl", "entropy", "logprob_mismatch")  # token-weighted means
SHARES = ("loss", "ref_kl")  # aggregated with the mini-batch's global counts: each rank holds a share


def minibatch_rows(group_ids: torch.Tensor, mini_batches: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch; a group never spans two mini-batches."""
    groups = torch.unique(group_ids)
    return [torch.nonzero(torch.isin(group_ids, chunk)).flatten() for chunk in torch.tensor_split(groups, mini_batches)]


def loss_mask(batch: TrainBatch, overlong_filter: bool) -> torch.Tensor:
    """Response tokens; with DAPO overlong filtering, truncated samples are masked out entirely."""
    if not overlong_filter:
        return batch.response_mask
    return batch.response_mask * (~batch.truncated).float().unsqueeze(-1)


def train_on_batch(
    backend, batch: TrainBatch, alg: AlgorithmConfig, tcfg: TrainerConfig, *, temperature: float, norm_len: int
) -> dict[str, float]:
    rank, world = backend.dp_rank, backend.dp_size  # data-parallel: with TP/PP, several ranks share rows
    advantages = compute_advantages(alg.advantage, batch.rewards, batch.group_ids, norm_by_std=alg.norm_by_std)
    mask = loss_mask(batch, alg.overlong_filter)
    minibatches = minibatch_rows(batch.group_ids, tcfg.mini_batches)
    shards = [rows[rank::world] for rows in minibatches]

    with torch.no_grad():  # the behaviour ("old") policy: this step's weights before any update
        old = [backend.logprobs(batch.input_ids[s], batch.attention_mask[s], temperature)[0] for s in shards]
        ref = (
            [
                backend.logprobs(batch.input_ids[s], batch.attention_mask[s], temperature, reference=True)[0]
                for s in shards
            ]
            if alg.kl_coef > 0
            else None
        )

    sums = torch.zeros(len(METRIC_SUMS) + 1, dtype=torch.float64)  # + token count
    shares = torch.zeros(len(SHARES), dtype=torch.float64)
    mismatch_max = torch.zeros(1, dtype=torch.float64)
    grad_norms = []
    for _epoch in range(tcfg.epochs):
        for k, (rows, shard) in enumerate(zip(minibatches, shards)):
            m = mask[shard].to(backend.device)
            counts = {
                "num_tokens": float(mask[rows].sum().clamp(min=1)),
                "num_seqs": float(max(1, int((mask[rows].sum(-1) > 0).sum())))
                if alg.loss_agg == "seq-mean-token-mean"
                else float(len(rows)),
                "norm_len": norm_len,
            }
            logprob, entropy = backend.logprobs(batch.input_ids[shard], batch.attention_mask[shard], temperature)
            adv = advantages[shard].to(backend.device).unsqueeze(-1).expand_as(logprob)
            is_weights = None
            if alg.tis_cap is not None:
                is_weights = torch.exp(old[k] - batch.rollout_logprobs[shard].to(backend.device)).clamp(max=alg.tis_cap)
            loss_mat, pg = compute_policy_loss(
                alg.policy_loss, logprob, old[k], adv, m,
                clip_low=alg.clip_low, clip_high=alg.clip_high, clip_c=alg.clip_c, is_weights=is_weights,
            )  # fmt: skip
            loss = agg_loss(loss_mat, m, alg.loss_agg, **counts)
            ref_kl = torch.zeros((), device=backend.device)
            if ref is not None:
                ref_kl = agg_loss(kl_penalty(logprob, ref[k], alg.kl_estimator), m, alg.loss_agg, **counts)
                loss = loss + alg.kl_coef * ref_kl
            if alg.entropy_coef > 0:
                loss = loss - alg.entropy_coef * agg_loss(entropy, m, alg.loss_agg, **counts)
            (loss * world).backward()
            grad_norms.append(backend.step(tcfg.grad_clip))
            tokens = float(m.sum())
            gap = (old[k] - batch.rollout_logprobs[shard].to(backend.device)).abs() * m
            mismatch = gap.sum() / max(tokens, 1)
            mismatch_max = torch.maximum(mismatch_max, gap.max().double().cpu().reshape(1))
            entropy_mean = (entropy.detach() * m).sum() / max(tokens, 1)
            values = [
                pg["clip_frac"],
                pg["dual_clip_frac"],
                pg["approx_kl"],
                entropy_mean,
                mismatch,
            ]
            sums[:-1] += torch.tensor([float(v) * tokens for v in values], dtype=torch.float64)
            sums[-1] += tokens
            shares += torch.tensor([float(loss.detach()), float(ref_kl)], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(shares)
    dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
    tokens = max(float(sums[-1]), 1.0)
    metrics = {name: float(sums[i]) / tokens for i, name in enumerate(METRIC_SUMS)}
    # A mini-batch's loss (and KL term) is the sum of its data-parallel shares; each share is held by the
    # world / dp_size ranks of one model replica. Mean over the optimizer steps.
    replicas = dist.get_world_size() // world
    for i, name in enumerate(SHARES):
        metrics[name] = float(shares[i]) / replicas / (tcfg.epochs * len(minibatches))
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["logprob_mismatch_max"] = float(mismatch_max)  # max |trainer - engine| logprob, behaviour policy
    metrics["kl"] = metrics["ref_kl"] if alg.kl_coef > 0 else metrics["ppo_kl"]
    return metrics
