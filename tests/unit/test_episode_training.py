"""An episode trains as one sample whose loss mask is 0 on observation tokens: nothing at a mask-0 position (its
logprob, old logprob, reference logprob, entropy) changes the loss, its gradient or a policy metric, for every
loss aggregation; the batch puts the mask, logprobs and versions on the right positions."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms import agg_loss, compute_policy_loss, kl_penalty
from relayrl.algorithms.aggregation import LOSS_AGGREGATIONS
from relayrl.trainer.batch import to_train_batch
from relayrl.v1 import controller_pb2

# one episode: 3 prompt tokens, then sampled (1) / observation (0) tokens
MASK = [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1]


def episode_sample(group: int = 0) -> controller_pb2.Sample:
    return controller_pb2.Sample(
        prompt_id="p",
        group=group,
        prompt_token_ids=[5, 6, 7],
        response_token_ids=list(range(10, 10 + len(MASK))),
        rollout_logprobs=[-0.5 if m else 0.0 for m in MASK],
        loss_mask=bytes(MASK),
        token_versions=[3 if m else 0 for m in MASK],
        policy_version=3,
        reward=1.0,
    )


def test_the_batch_carries_the_episode_mask_on_the_response_positions():
    batch = to_train_batch([episode_sample(), episode_sample(1)], pad_token_id=0)
    span = slice(2, 2 + len(MASK))  # position t scores token t + 1: the response starts at prompt length - 1
    assert batch.response_mask[0, span].tolist() == MASK
    assert batch.response_mask[0, :2].sum() == 0
    assert batch.rollout_logprobs[0, span].tolist() == [-0.5 if m else 0.0 for m in MASK]
    assert batch.token_versions[0, span].tolist() == [3 if m else -1 for m in MASK]


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS.names()))
def test_mask_0_positions_change_nothing(agg):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([MASK, [1] * len(MASK)], dtype=torch.float32)
    logprob = (torch.randn(2, len(MASK), generator=g) - 1).requires_grad_()
    old, ref = logprob.detach() - 0.1, logprob.detach() + 0.2
    entropy = torch.rand(2, len(MASK), generator=g)
    adv = torch.tensor([[1.0], [-0.5]]).expand(2, len(MASK))

    def loss(lp, old, ref, entropy):
        mat, pg = compute_policy_loss("ppo_clip", lp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
        total = agg_loss(mat, mask, agg, norm_len=16)
        total = total + 0.1 * agg_loss(kl_penalty(lp, ref, "k3"), mask, agg, norm_len=16)
        return total - 0.01 * agg_loss(entropy, mask, agg, norm_len=16), pg

    base, pg = loss(logprob, old, ref, entropy)
    (grad,) = torch.autograd.grad(base, logprob)
    off = mask == 0
    noisy = logprob.detach().clone()
    noisy[off] = 40.0  # anything at an observation token
    noisy.requires_grad_()
    old2, ref2, ent2 = old.clone(), ref.clone(), entropy.clone()
    old2[off], ref2[off], ent2[off] = -30.0, 25.0, 1e6
    other, pg2 = loss(noisy, old2, ref2, ent2)
    (grad2,) = torch.autograd.grad(other, noisy)
    assert torch.allclose(base, other)
    assert torch.all(grad[off] == 0) and torch.all(grad2[off] == 0)
    assert torch.allclose(grad[~off], grad2[~off])
    assert {k: float(v) for k, v in pg.items()} == pytest.approx({k: float(v) for k, v in pg2.items()})
