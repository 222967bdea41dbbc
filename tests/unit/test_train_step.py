"""The training step's old logprobs: the engine's when exact (no extra forward), the same update as recomputing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_testing import full_weights, one_rank_world, rollout_batch  # noqa: F401 (an autouse fixture)
from transformers import AutoModelForCausalLM

from relayrl.algorithms.advantages import compute_advantages
from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import right_padded
from relayrl.trainer.step import train_on_batch


class CountingBackend(FSDPBackend):
    """The FSDP backend, counting forward passes."""

    forwards = 0

    def logprobs(self, *args, **kwargs):
        self.forwards += 1
        return super().logprobs(*args, **kwargs)


def train(tiny_model_dir, old_logprobs: str, exact: bool) -> tuple[CountingBackend, dict]:
    torch.manual_seed(0)
    tcfg = TrainerConfig(lr=0.01, mini_batches=2, precision="float32")  # engine logprobs equal to float rounding
    backend = CountingBackend(ModelConfig(path=str(tiny_model_dir)), tcfg, with_reference=False)
    batch = rollout_batch(backend)
    batch = dataclasses.replace(batch, exact_rollout=torch.full_like(batch.exact_rollout, exact))
    backend.forwards = 0
    alg = AlgorithmConfig(old_logprobs=old_logprobs)
    metrics = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=7)
    return backend, metrics


def test_exact_batches_skip_the_old_logprob_forward_and_train_the_same(tiny_model_dir) -> None:
    engine, engine_metrics = train(tiny_model_dir, "auto", exact=True)
    recomputed, recomputed_metrics = train(tiny_model_dir, "recompute", exact=True)
    # 2 mini-batches; recompute forwards the second one's old logprobs before the first update, while the first
    # one's are its own training forward (nothing updated yet)
    assert engine.forwards == 2 and recomputed.forwards == 3
    assert engine_metrics["old_logprobs_from_engine"] == 1.0 and recomputed_metrics["old_logprobs_from_engine"] == 0
    expected = full_weights(recomputed)
    for name, tensor in full_weights(engine).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=name)
    # the mismatch is still measured, from the first mini-batch's forward at the step's starting weights
    assert engine_metrics["logprob_mismatch_max"] < 1e-5
    assert abs(engine_metrics["loss"] - recomputed_metrics["loss"]) < 1e-5


def test_a_batch_not_generated_by_the_starting_weights_is_recomputed(tiny_model_dir) -> None:
    backend, metrics = train(tiny_model_dir, "auto", exact=False)
    assert backend.forwards == 3 and metrics["old_logprobs_from_engine"] == 0


def test_rollout_old_logprobs_take_the_engines_for_any_batch(tiny_model_dir) -> None:
    """``old_logprobs: rollout`` anchors on the behaviour policy whatever its version: no forward for old logprobs.
    Here the rollout logprobs are the starting weights' own, so the update is the recomputed one."""
    bypass, bypass_metrics = train(tiny_model_dir, "rollout", exact=False)
    recomputed, _ = train(tiny_model_dir, "recompute", exact=False)
    assert bypass.forwards == 2 and bypass_metrics["old_logprobs_from_engine"] == 1.0
    expected = full_weights(recomputed)
    for name, tensor in full_weights(bypass).items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=name)


def test_more_epochs_keep_the_first_minibatchs_old_logprobs(tiny_model_dir) -> None:
    """With two passes the first mini-batch's old logprobs (its first training forward) stay those of the starting
    weights: the second pass's clip anchors on them, as it does on the engine's exact ones."""
    results = {}
    for mode in ("auto", "recompute"):
        torch.manual_seed(0)
        tcfg = TrainerConfig(lr=0.01, mini_batches=2, epochs=2, precision="float32")
        backend = CountingBackend(ModelConfig(path=str(tiny_model_dir)), tcfg, with_reference=False)
        batch = rollout_batch(backend)
        metrics = train_on_batch(backend, batch, AlgorithmConfig(old_logprobs=mode), tcfg, temperature=1.0, norm_len=7)
        results[mode] = full_weights(backend), metrics
    for name, tensor in results["auto"][0].items():
        torch.testing.assert_close(tensor, results["recompute"][0][name], atol=1e-5, rtol=0, msg=name)
    assert abs(results["auto"][1]["clip_frac"] - results["recompute"][1]["clip_frac"]) < 1e-6


@pytest.mark.parametrize("padding", ["right", "left"])
def test_logprobs_of_a_padded_batch_equal_a_plain_forward_with_its_mask(tiny_model_dir, padding) -> None:
    """A right-padded batch goes in without its mask (causal attention never looks right): its valid positions
    equal the masked forward bit for bit. Any other layout keeps its mask."""
    backend = FSDPBackend(
        ModelConfig(path=str(tiny_model_dir)), TrainerConfig(precision="float32"), with_reference=False
    )
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    rows, length = 6, 12
    lengths = torch.tensor([12, 9, 7, 12, 5, 10])
    valid = torch.arange(length)[None] < lengths[:, None]
    if padding == "left":
        valid = valid.flip(-1)
    mask = valid.long()
    input_ids = torch.randint(2, 20, (rows, length), generator=g) * mask
    assert right_padded(mask) == (padding == "right")
    with torch.no_grad():
        got = backend.logprobs(input_ids, mask, 1.0)[0]
        logits = plain(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        want = logprobs_from_logits(logits, input_ids[:, 1:])
    scored = valid[:, 1:] & valid[:, :-1]
    assert torch.equal(got[scored], want[scored])


def test_gspo_trains_stale_batches_under_truncated_importance_sampling(tiny_model_dir) -> None:
    """GSPO through the trainer's step as the token loss goes: a batch not generated by the starting weights (its
    old logprobs recomputed) whose rollout logprobs differ from them, with TIS weights capped. The first
    mini-batch's ratio is 1 (unclipped, the weights move); the second, after an update at lr 0.01, strays beyond
    GSPO's 4e-4 and is clipped."""
    torch.manual_seed(0)
    tcfg = TrainerConfig(lr=0.01, mini_batches=2)
    backend = FSDPBackend(ModelConfig(path=str(tiny_model_dir)), tcfg, with_reference=False)
    batch = rollout_batch(backend)
    stale = batch.rollout_logprobs - 0.05 * torch.rand(batch.rollout_logprobs.shape) * batch.response_mask
    batch = dataclasses.replace(batch, exact_rollout=torch.zeros_like(batch.exact_rollout), rollout_logprobs=stale)
    alg = AlgorithmConfig(policy_loss="gspo", tis_cap=2.0)
    assert (alg.clip_low, alg.clip_high, alg.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    before = full_weights(backend)
    metrics = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=7)
    after = full_weights(backend)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert 0.0 < metrics["clip_frac"] < 1.0 and metrics["old_logprobs_from_engine"] == 0.0
    assert all(v == v for v in metrics.values() if isinstance(v, float))  # no NaN


def test_distill_with_a_task_advantage_trains_each_token_on_both(tiny_model_dir) -> None:
    """algorithm.distill_task_advantage: each sample's advantage is its task reward's (grpo over its group) plus the
    mean of its tokens' distillation advantages, as the step reports them per sample."""
    tcfg = TrainerConfig(lr=0.01, mini_batches=2, precision="float32")
    backend = FSDPBackend(ModelConfig(path=str(tiny_model_dir)), tcfg, with_reference=False)
    batch = rollout_batch(backend)
    shift = torch.linspace(-1.0, 1.0, batch.rollout_logprobs.numel()).reshape(batch.rollout_logprobs.shape)
    batch = dataclasses.replace(batch, teacher_logprobs=(batch.rollout_logprobs + shift) * batch.response_mask)
    reported = {}
    for task in (None, "grpo"):
        alg = AlgorithmConfig(advantage="distill", teacher="t", distill_coef=0.5, distill_task_advantage=task)
        train_on_batch(
            backend,
            batch,
            alg,
            tcfg,
            temperature=1.0,
            norm_len=7,
            on_advantages=lambda a, task=task: reported.update({task: a}),
        )
    mask = batch.response_mask
    distill = (0.5 * shift * mask).sum(-1) / mask.sum(-1)  # -coef (student - teacher) = coef x shift, token mean
    grpo = compute_advantages("grpo", batch.rewards, batch.group_ids)
    torch.testing.assert_close(reported[None], distill.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(reported["grpo"], (grpo + distill).float(), atol=1e-6, rtol=0)
    assert float(grpo.abs().max()) > 0.5  # the task's advantage is no rounding beside the distillation's
