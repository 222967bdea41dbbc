"""What a trained sample is: the loss mask and per-token versions travel from the wire into the TrainBatch."""

from __future__ import annotations

import pytest
import torch

from relayrl.trainer.batch import to_train_batch
from relayrl.v1 import controller_pb2

PAD = 0


def sample(**fields) -> controller_pb2.Sample:
    return controller_pb2.Sample(prompt_id="p", group=0, worker_id="w0", **fields)


def test_single_turn_sample_trains_every_response_token_at_its_version() -> None:
    s = sample(prompt_token_ids=[5, 6, 7], response_token_ids=[8, 9], rollout_logprobs=[-0.5, -1.0], policy_version=3)
    batch = to_train_batch([s], PAD, version=3, verified_workers=frozenset({"w0"}))
    assert batch.response_mask.tolist() == [[0, 0, 1, 1]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, -0.5, -1.0]]
    assert batch.token_versions.tolist() == [[-1, -1, 3, 3]]
    assert batch.exact_rollout.tolist() == [True]


def test_episode_masks_observation_tokens_and_keeps_each_tokens_version() -> None:
    # prompt [5, 6]; turn 1 sampled [10, 11] at v2; observation [20, 21] (mask 0); turn 2 sampled [12] at v3
    s = sample(
        prompt_token_ids=[5, 6],
        response_token_ids=[10, 11, 20, 21, 12],
        rollout_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        loss_mask=bytes([1, 1, 0, 0, 1]),
        token_versions=[2, 2, 0, 0, 3],
        policy_version=2,
    )
    batch = to_train_batch([s], PAD, version=3, verified_workers=frozenset({"w0"}))
    assert batch.input_ids.tolist() == [[5, 6, 10, 11, 20, 21, 12]]
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert batch.token_versions.tolist() == [[-1, 2, 2, -1, -1, 3]]
    assert torch.allclose(batch.rollout_logprobs, torch.tensor([[0, -0.1, -0.2, 0, 0, -0.3]]))
    assert batch.versions.tolist() == [2]
    assert batch.exact_rollout.tolist() == [False]  # its first turn was sampled by an older version


def test_mask_of_the_wrong_length_names_the_field() -> None:
    s = sample(prompt_token_ids=[5], response_token_ids=[8, 9], rollout_logprobs=[0, 0], loss_mask=b"\x01")
    with pytest.raises(ValueError, match="loss_mask"):
        to_train_batch([s], PAD)
