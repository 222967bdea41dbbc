"""Rows of zero advantage (trainer.skip_zero_advantage): not forwarded, and the update is the one that trains them,
on three architectures (shared prompts under SDPA; eager attention with a window and soft-capping; a scaled head);
where another term of the loss reads every row they are trained."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from trainer_testing import full_weights, grpo_batch, one_rank_world  # noqa: F401 (an autouse fixture)

from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.models.families import write_family_model
from relayrl.trainer import step as step_module
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.step import gradient_rows, train_on_batch

FAMILIES = ("qwen2", "gemma2", "granite")


class RowCountingBackend(FSDPBackend):
    """The FSDP backend, counting the rows its forwards take."""

    rows = 0

    def logprobs(self, input_ids, *args, **kwargs):
        self.rows += len(input_ids)
        return super().logprobs(input_ids, *args, **kwargs)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: str(write_family_model(family, root / family)) for family in FAMILIES}


def with_rewards(batch, rewards_by_group: dict[int, list[float]]):
    """``batch`` with the rewards of the groups named replaced (a group's rows in order)."""
    rewards = batch.rewards.clone()
    for group, values in rewards_by_group.items():
        rows = (batch.group_ids == group).nonzero().flatten()
        rewards[rows] = torch.tensor(values[: len(rows)], dtype=rewards.dtype)
    return dataclasses.replace(batch, rewards=rewards)


def step(model_dir: str, batch, *, skip: bool, alg: AlgorithmConfig | None = None, **trainer) -> tuple:
    """One step from the saved weights (seed 0): the backend, its metrics, the weights after."""
    tcfg = TrainerConfig(lr=0.01, precision="float32", skip_zero_advantage=skip, **trainer)
    torch.manual_seed(0)
    backend = RowCountingBackend(ModelConfig(path=model_dir), tcfg, with_reference=False)
    metrics = train_on_batch(backend, batch, alg or AlgorithmConfig(), tcfg, temperature=1.0, norm_len=8)
    return backend, metrics, full_weights(backend)


def assert_same_weights(got: dict, expected: dict) -> None:
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_that_scored_alike_are_not_forwarded_and_the_update_is_the_same(family, family_dirs) -> None:
    # groups 0 and 2 scored alike (zero advantage), group 1 did not; group 3 is one row (zero advantage too)
    batch = with_rewards(grpo_batch(), {0: [1.0] * 4, 1: [0.0, 1.0, 1.0, 0.0], 2: [0.0] * 4})
    skipped, metrics, weights = step(family_dirs[family], batch, skip=True, mini_batches=2)
    trained, all_metrics, expected = step(family_dirs[family], batch, skip=False, mini_batches=2)
    assert_same_weights(weights, expected)
    # trained: group 1, and one row of the second mini-batch, which also forwards its old logprobs (the engine's are
    # not the starting weights' here); against every row and the second mini-batch's five again
    assert skipped.rows == 4 + 1 + 1 and trained.rows == 13 + 5
    assert metrics["zero_advantage_skipped"] == pytest.approx(8 / 13) and all_metrics["zero_advantage_skipped"] == 0
    assert metrics["loss"] == pytest.approx(all_metrics["loss"], abs=1e-6)


def test_a_mini_batch_with_no_gradient_still_steps_the_optimizer(family_dirs) -> None:
    # every group scored alike (the one-row group's advantage is its reward: 0), so AdamW's decoupled weight decay
    # moves the weights on a gradient of zeros, with every row or with one
    batch = with_rewards(grpo_batch(), {0: [0.5] * 4, 1: [1.0] * 4, 2: [0.5] * 4, 3: [0.0]})
    skipped, metrics, weights = step(family_dirs["qwen2"], batch, skip=True, weight_decay=0.1)
    _, _, expected = step(family_dirs["qwen2"], batch, skip=False, weight_decay=0.1)
    assert_same_weights(weights, expected)
    assert skipped.rows == 1 and metrics["zero_advantage_skipped"] == pytest.approx(12 / 13)
    assert metrics["grad_norm"] == 0.0
    before = full_weights(FSDPBackend(ModelConfig(path=family_dirs["qwen2"]), TrainerConfig(), with_reference=False))
    assert any(not torch.equal(weights[name], before[name]) for name in weights)


@pytest.mark.parametrize(
    ("alg", "why"),
    [
        (AlgorithmConfig(entropy_coef=0.01), "entropy bonus"),
        (AlgorithmConfig(rollout_correction={"rollout_rs": "token_k3", "rollout_rs_threshold": 2.0}), "rejects"),
    ],
)
def test_a_term_that_reads_every_row_trains_them_all_and_says_why(alg, why, family_dirs, caplog, monkeypatch) -> None:
    monkeypatch.setattr(step_module, "_LOGGED", set())  # said once a process: another test may have said it
    batch = with_rewards(grpo_batch(), {0: [1.0] * 4})
    with caplog.at_level(logging.INFO, logger="relayrl.trainer.step"):
        backend, metrics, _ = step(family_dirs["qwen2"], batch, skip=True, alg=alg)
    assert backend.rows == len(batch) and metrics["zero_advantage_skipped"] == 0
    assert why in caplog.text


def test_gradient_rows_keep_one_row_per_rank_in_batch_order() -> None:
    rows = torch.tensor([4, 5, 6, 7, 8, 9])
    advantages = torch.zeros(10)
    advantages[7] = 0.5
    assert gradient_rows(rows, advantages, world=1).tolist() == [7]
    assert gradient_rows(rows, advantages, world=3).tolist() == [4, 5, 7]
    assert gradient_rows(rows, torch.zeros(10), world=2).tolist() == [4, 5]
    per_token = torch.zeros(10, 3)
    per_token[9, 2] = -1.0  # a token advantage (GAE's, distillation's) counts at any token
    assert gradient_rows(rows, per_token, world=1).tolist() == [9]
