"""Helpers shared by the trainer tests (test_train_step.py, test_stream_step.py, test_fsdp_backend.py)."""

from __future__ import annotations

import torch

from relayrl.trainer.batch import TrainBatch


def full_weights(backend) -> dict[str, torch.Tensor]:
    """Every weight, whole, as the float32 parameters hold it, through the backend's own gather (collective: every
    rank calls it)."""
    into = {name: torch.empty(shape, dtype=torch.float32) for name, shape, _ in backend.weight_specs()}
    backend.gather_weights(into)
    return into


def rollout_batch(backend, groups: int = 4, n: int = 4, seed: int = 0) -> TrainBatch:
    """Random prompts and responses whose rollout logprobs are the backend's own at its current weights."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len, response_len = groups * n, 5, 7
    input_ids = torch.randint(2, 20, (rows, prompt_len + response_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros(rows, prompt_len + response_len - 1)
    response_mask[:, prompt_len - 1 :] = 1.0
    with torch.no_grad():
        rollout = backend.logprobs(input_ids, attention_mask, 1.0)[0] * response_mask
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rollout_logprobs=rollout,
        rewards=torch.rand(rows, generator=g),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
        exact_rollout=torch.ones(rows, dtype=torch.bool),
    )
