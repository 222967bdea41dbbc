"""A controller ``Batch`` as padded tensors, aligned for next-token prediction.

Row i is prompt_i + response_i, right-padded to the longest row. Position t of every [B, L-1]
tensor scores token t+1: ``response_mask[i, t]`` is 1 where token t+1 is a response token, and
``rollout_logprobs`` / advantages live on those same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from relayrl.v1 import common_pb2, controller_pb2


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    response_mask: torch.Tensor  # [B, L-1] float32
    rollout_logprobs: torch.Tensor  # [B, L-1] float32 (0 outside the response)
    rewards: torch.Tensor  # [B] float32
    scores: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] int64
    truncated: torch.Tensor  # [B] bool: finished by length
    versions: torch.Tensor  # [B] int64: policy version that produced the sample

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows ``index`` of every tensor (a mini-batch or a data-parallel shard)."""
        return TrainBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def to_train_batch(batch: controller_pb2.Batch, pad_token_id: int) -> TrainBatch:
    samples = list(batch.samples)
    if not samples:
        raise ValueError("batch.samples: empty batch")
    rows = [list(s.prompt_token_ids) + list(s.response_token_ids) for s in samples]
    length = max(len(r) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, (s, row) in enumerate(zip(samples, rows)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
        start, count = len(s.prompt_token_ids) - 1, len(s.response_token_ids)
        response_mask[i, start : start + count] = 1.0
        rollout_logprobs[i, start : start + count] = torch.tensor(list(s.rollout_logprobs), dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        scores=torch.tensor([s.score for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        truncated=torch.tensor([s.finish_reason == common_pb2.FINISH_REASON_LENGTH for s in samples]),
        versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long),
    )
