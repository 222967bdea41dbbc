"""The rollout correction in the trainer's step (relayrl/trainer/step.py): rejected tokens leave the loss and its
denominator, on-policy data trains as without it, and the diagnostics of the step's starting weights reach the
step's metrics (so metrics.jsonl and every sink)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from trainer_testing import full_weights, on_ranks_case, one_rank_world, rollout_batch, spawn_ranks  # noqa: F401 (an autouse fixture)

from relayrl.algorithms.rollout_correction import apply_correction, rollout_diagnostics
from relayrl.config import CORRECTION_PREFIX, AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.metrics import MetricsWriter, read_records
from relayrl.trainer.step import train_on_batch

DIAGNOSTICS = ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "log_ppl_diff", "ess", "ratio_mean", "ratio_max",
               "ratio_min", "rejected_token_share", "rejected_seq_share", "is_weight_mean", "is_weight_max",
               "is_weight_min")  # fmt: skip


def backend_of(model_dir, mini_batches: int = 2) -> tuple[FSDPBackend, TrainerConfig]:
    torch.manual_seed(0)
    tcfg = TrainerConfig(lr=0.01, mini_batches=mini_batches, precision="float32")
    return FSDPBackend(ModelConfig(path=str(model_dir)), tcfg, with_reference=False), tcfg


def stale_batch(backend, shift: dict[int, float]):
    """rollout_batch (the engine's log-probs are the starting weights' own) with rows ``shift`` sampled by an
    engine that disagrees by that much on every token, and one token of row 2 by 1.5: not exact, so the trainer
    recomputes its old log-probs (decoupled mode)."""
    batch = rollout_batch(backend)
    rollout = batch.rollout_logprobs.clone()
    for row, by in shift.items():
        rollout[row] -= by * batch.response_mask[row]
    rollout[2, 6] -= 1.5
    return dataclasses.replace(batch, rollout_logprobs=rollout, exact_rollout=torch.zeros_like(batch.exact_rollout))


def rejection_gaps(model_dir: str, loss_agg: str) -> dict[str, float]:
    """Rows 1 and 5 rejected (seq_mean_k3) and row 2's one far token (token_k2), against a batch whose loss mask
    never held them: the largest weight gap after one step, and the corrected step's rejected shares."""
    rc = {"rollout_rs": "seq_mean_k3,token_k2", "rollout_rs_threshold": "0.3,0.5"}
    backend, tcfg = backend_of(model_dir)
    batch = stale_batch(backend, {1: 1.0, 5: 0.8})
    metrics = train_on_batch(backend, batch, AlgorithmConfig(loss_agg=loss_agg, rollout_correction=rc), tcfg,
                             temperature=1.0, norm_len=7)  # fmt: skip
    corrected = full_weights(backend)
    backend, tcfg = backend_of(model_dir)
    mask = batch.response_mask.clone()
    mask[[1, 5]] = 0
    mask[2, 6] = 0
    plain = dataclasses.replace(batch, response_mask=mask, rollout_logprobs=rollout_batch(backend).rollout_logprobs)
    train_on_batch(backend, plain, AlgorithmConfig(loss_agg=loss_agg), tcfg, temperature=1.0, norm_len=7)
    gap = max(float((corrected[k] - v).abs().max()) for k, v in full_weights(backend).items())
    shares = {k: metrics[CORRECTION_PREFIX + k] for k in ("rejected_token_share", "rejected_seq_share")}
    return {"gap": gap, "tokens": float(batch.response_mask.sum()), **shares}


def check_rejection(result: dict[str, float]) -> None:
    assert result["gap"] < 2e-6
    assert result["rejected_token_share"] == pytest.approx(15 / result["tokens"])  # 7 + 7 + 1
    assert result["rejected_seq_share"] == pytest.approx(2 / 16)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_rejected_tokens_train_as_if_they_were_never_in_the_loss(tiny_model_dir, loss_agg) -> None:
    """The same update as a batch whose loss mask never held the rejected tokens: the denominators count the kept
    tokens only, and a rejected row adds nothing."""
    check_rejection(rejection_gaps(str(tiny_model_dir), loss_agg))


def test_two_ranks_count_the_kept_tokens_of_both(tiny_model_dir, tmp_path) -> None:
    """On 2 data-parallel ranks each holds half the rows: the kept-token counts (and the diagnostics) are summed over
    both, so the update is still the one without the rejected tokens."""
    out = tmp_path / "result.json"
    spawn_ranks(on_ranks_case, (2, free_port(), rejection_gaps, (str(tiny_model_dir), "token-mean"), str(out)), 2)
    check_rejection(json.loads(out.read_text()))


def test_on_policy_data_trains_as_without_a_correction(tiny_model_dir) -> None:
    """The engine's log-probs are the trainer's: weights 1, nothing rejected, the same update."""
    rc = {"rollout_is": "sequence", "rollout_is_mode": "mask", "rollout_is_threshold": "0.999_1.001",
          "rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.999_1.001,1e-6"}  # fmt: skip
    results = []
    for alg in (AlgorithmConfig(rollout_correction=rc), AlgorithmConfig()):
        backend, tcfg = backend_of(tiny_model_dir)
        batch = rollout_batch(backend)
        batch = dataclasses.replace(batch, exact_rollout=torch.zeros_like(batch.exact_rollout))
        results.append((train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=7), full_weights(backend)))
    (metrics, corrected), (_, plain) = results
    for name, tensor in plain.items():
        torch.testing.assert_close(corrected[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert metrics[CORRECTION_PREFIX + "rejected_token_share"] == 0
    assert metrics[CORRECTION_PREFIX + "is_weight_min"] == pytest.approx(1, abs=1e-5)
    assert metrics[CORRECTION_PREFIX + "is_weight_max"] == pytest.approx(1, abs=1e-5)


def test_bypass_and_decoupled_reject_alike_on_policy(tiny_model_dir) -> None:
    """On-policy, one mini-batch: bypass (old_logprobs rollout: rejection reads the current forward) and decoupled
    (recompute: the trainer's old log-probs) see the same log-probs, reject nothing and make the same update."""
    rc = {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.999_1.001,1e-6"}
    results = {}
    for mode in ("rollout", "recompute"):
        backend, tcfg = backend_of(tiny_model_dir, mini_batches=1)
        batch = rollout_batch(backend)
        alg = AlgorithmConfig(old_logprobs=mode, rollout_correction=rc)
        results[mode] = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=7), full_weights(backend)
    for mode, (metrics, _) in results.items():
        assert metrics[CORRECTION_PREFIX + "rejected_token_share"] == 0, mode
        assert metrics["old_logprobs_from_engine"] == float(mode == "rollout")
    for name, tensor in results["recompute"][1].items():
        torch.testing.assert_close(results["rollout"][1][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_two_steps_write_the_diagnostics_of_each_steps_starting_weights(tiny_model_dir, tmp_path) -> None:
    """Each step's rollout_corr/* metrics are the pure functions' on the trainer's log-probs before that step's
    first update (its starting weights), and reach metrics.jsonl."""
    rc = {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k2", "rollout_rs_threshold": 0.5}
    alg = AlgorithmConfig(rollout_correction=rc)
    backend, tcfg = backend_of(tiny_model_dir)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in (1, 2):
        batch = stale_batch(backend, {3: 0.3})
        with torch.no_grad():
            start = backend.logprobs(batch.input_ids, batch.attention_mask, 1.0)[0]
        mask = batch.response_mask
        correction = apply_correction(alg.correction, proximal=start, behaviour=batch.rollout_logprobs, trainer=start,
                                      mask=mask)  # fmt: skip
        want = rollout_diagnostics(start, batch.rollout_logprobs, mask, correction)
        metrics = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=7)
        for name in DIAGNOSTICS:
            assert metrics[CORRECTION_PREFIX + name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), (step, name)
        assert metrics[CORRECTION_PREFIX + "kl_k3"] > 1e-3 and metrics[CORRECTION_PREFIX + "rejected_token_share"] > 0
        required = dict.fromkeys(["policy_version", "reward_mean", "rollout_version_min", "groups_kept",
                                  "groups_filtered", "gen_batches", "response_len_mean", "sync_seconds",
                                  "step_seconds", "samples_per_second"], 0)  # fmt: skip
        writer.write({**required, **metrics, "step": step})
    writer.close()
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(CORRECTION_PREFIX + name in r for r in records for name in DIAGNOSTICS)
