"""Rollout correction (relayrl/algorithms/rollout_correction.py), each function against its formula written out
token by token, on random multi-turn masks (observation tokens in between, padding after)."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.aggregation import agg_loss
from relayrl.algorithms.rollout_correction import (
    IS_LEVELS,
    Correction,
    applied_sums,
    apply_correction,
    icepop,
    importance_weights,
    log_ratio_of,
    normalised,
    rejection_keep,
    rollout_diagnostics,
    weight_sums,
)
from relayrl.config import RS_CRITERIA, Bounds, RolloutCorrectionConfig
from relayrl.trainer.batch import to_train_batch
from relayrl.v1 import controller_pb2

ROWS, LENGTH = 6, 11


def multi_turn(seed: int, spread: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer, behaviour, mask): random log-probs; each row two sampled turns with an observation between them
    and padding after, one row empty; NaN wherever the mask is 0 (such tokens must never count)."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(ROWS, LENGTH, generator=g) * 3
    trainer = behaviour + spread * torch.randn(ROWS, LENGTH, generator=g)
    mask = torch.zeros(ROWS, LENGTH)
    for i in range(ROWS - 1):
        first = int(torch.randint(1, 4, (1,), generator=g))
        gap = int(torch.randint(1, 3, (1,), generator=g))
        second = int(torch.randint(1, LENGTH - first - gap, (1,), generator=g))
        mask[i, :first] = 1
        mask[i, first + gap : first + gap + second] = 1
    nan = torch.full_like(mask, math.nan)
    return torch.where(mask.bool(), trainer, nan), torch.where(mask.bool(), behaviour, nan), mask


def tokens_of(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def expected_log_weight(delta: torch.Tensor, mask: torch.Tensor, level: str, i: int, t: int) -> float:
    own = tokens_of(mask, i)
    if level == "token":
        return float(delta[i, t])
    total = sum(float(delta[i, u]) for u in own)
    return total if level == "sequence" else total / len(own)


@pytest.mark.parametrize("level", IS_LEVELS.names())
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("spec", [Bounds(1.3), Bounds(1.2, 0.8)])
def test_importance_weights_follow_their_formula_and_ignore_masked_tokens(level, mode, spec) -> None:
    trainer, behaviour, mask = multi_turn(seed=1)
    delta = log_ratio_of(trainer, behaviour)
    got = importance_weights(delta, mask, level=level, bounds=spec, mode=mode)
    for i in range(ROWS):
        for t in range(LENGTH):
            if not mask[i, t]:
                assert got.weights[i, t] == 0 and not got.keep[i, t]
                continue
            w = math.exp(expected_log_weight(delta, mask, level, i, t))
            lower = spec.lower or 0.0
            if mode == "truncate":
                want, kept = min(max(w, lower), spec.upper), True
            else:
                kept = lower <= w <= spec.upper
                want = w if kept else 0.0
            assert bool(got.keep[i, t]) == kept, (i, t, w)
            assert float(got.weights[i, t]) == pytest.approx(want, rel=1e-5), (i, t)
    assert not got.weights.requires_grad


def test_icepop_keeps_token_ratios_inside_its_bounds_and_drops_the_rest() -> None:
    trainer, behaviour, mask = multi_turn(seed=2, spread=0.8)
    delta = log_ratio_of(trainer, behaviour)
    got = icepop(delta, mask, lower=0.5, upper=2.0)
    ratio = torch.exp(torch.nan_to_num(delta))
    inside = mask.bool() & (ratio >= 0.5) & (ratio <= 2.0)
    assert torch.equal(got.keep, inside) and 0 < int(inside.sum()) < int(mask.sum())  # some tokens dropped
    torch.testing.assert_close(got.weights, torch.where(inside, ratio, 0.0))


@pytest.mark.parametrize("level", IS_LEVELS.names())
def test_batch_normalisation_gives_weights_of_mean_one(level) -> None:
    trainer, behaviour, mask = multi_turn(seed=3)
    got = importance_weights(log_ratio_of(trainer, behaviour), mask, level=level, bounds=Bounds(5.0))
    sums = weight_sums(got, level)
    # added over two "ranks" (two halves of the rows), as the trainer does over data-parallel ranks
    halves = [Correction(got.weights[s], got.keep[s]) for s in (slice(0, 3), slice(3, None))]
    torch.testing.assert_close(sum(weight_sums(h, level) for h in halves), sums)
    norm = normalised(got, sums)
    if level == "token":
        mean = float(norm.weights[norm.keep].mean())
    else:  # one weight per row with a kept token
        mean = float(torch.stack([norm.weights[i][norm.keep[i]][0] for i in range(ROWS) if norm.keep[i].any()]).mean())
    assert mean == pytest.approx(1.0, rel=1e-6)


def between(values: list[float], q: float) -> float:
    """Midway between the distinct values around the ``q`` quantile: a threshold no value sits on (float32 and
    float64 then agree on every comparison)."""
    distinct = sorted(set(values))
    at = min(int(q * (len(distinct) - 1)), len(distinct) - 2)
    return (distinct[at] + distinct[at + 1]) / 2


def divergence(k: str, delta: float) -> float:
    """KL(behaviour || trainer) estimators per token with δ = log π_trainer − log π_behaviour."""
    return {"k1": -delta, "k2": 0.5 * delta * delta, "k3": math.exp(delta) - 1 - delta}[k]


@pytest.mark.parametrize("criterion", RS_CRITERIA)
def test_each_rejection_criterion_keeps_what_its_formula_keeps(criterion) -> None:
    """The statistic written out per token; thresholds at the data's quartiles, so each criterion keeps some tokens
    and rejects others."""
    trainer, behaviour, mask = multi_turn(seed=4, spread=0.4)
    delta = log_ratio_of(trainer, behaviour)
    level, k = criterion.rsplit("_", 1)
    stats = {}
    for i in range(ROWS):
        values = [divergence(k, float(delta[i, t])) for t in tokens_of(mask, i)]
        for t in tokens_of(mask, i):
            stats[i, t] = {
                "token": divergence(k, float(delta[i, t])),
                "seq_sum": sum(values),
                "seq_mean": sum(values) / len(values),
                "seq_max": max(values),
            }[level]
    if k == "k1":  # ratio bounds holding 1
        ratios = [math.exp(-v) for v in stats.values()]
        bounds = Bounds(max(1.0, between(ratios, 0.75)), min(1.0, between(ratios, 0.25)))
    else:
        bounds = Bounds(between(list(stats.values()), 0.5))
    keep = rejection_keep(trainer, behaviour, mask, [(criterion, bounds)])
    for i in range(ROWS):
        for t in range(LENGTH):
            if not mask[i, t]:
                assert not keep[i, t]
                continue
            stat = stats[i, t]
            want = bounds.lower <= math.exp(-stat) <= bounds.upper if k == "k1" else stat <= bounds.upper
            assert bool(keep[i, t]) == want, (criterion, i, t, stat)
    assert 0 < int(keep.sum()) < int(mask.sum()), criterion  # the thresholds bite on this data


def test_a_k1_criterion_with_one_bound_takes_its_reciprocal_as_the_lower() -> None:
    trainer, behaviour, mask = multi_turn(seed=5)
    one = rejection_keep(trainer, behaviour, mask, [("token_k1", Bounds(1.2))])
    two = rejection_keep(trainer, behaviour, mask, [("token_k1", Bounds(1.2, 1 / 1.2))])
    assert torch.equal(one, two)


def test_criteria_together_keep_what_every_one_keeps() -> None:
    trainer, behaviour, mask = multi_turn(seed=6)
    a, b = ("token_k2", Bounds(0.02)), ("seq_mean_k3", Bounds(0.05))
    both = rejection_keep(trainer, behaviour, mask, [a, b])
    assert torch.equal(
        both, rejection_keep(trainer, behaviour, mask, [a]) & rejection_keep(trainer, behaviour, mask, [b])
    )


def test_the_denominator_is_the_kept_tokens_and_a_rejected_row_contributes_nothing() -> None:
    """The loss over the kept mask equals the loss of the kept tokens alone: token-mean divides by their count;
    seq-mean-token-mean by the rows that keep a token, so a row with every token rejected adds nothing."""
    trainer, behaviour, mask = multi_turn(seed=7)
    cfg = RolloutCorrectionConfig(rollout_rs="seq_sum_k2", rollout_rs_threshold=0.3)
    got = apply_correction(cfg, proximal=trainer, behaviour=behaviour, trainer=trainer, mask=mask)
    rows_kept = got.keep.any(-1)
    assert 0 < int(rows_kept.sum()) < int(mask.any(-1).sum())  # a whole row is rejected, others stay
    loss = torch.randn(ROWS, LENGTH, generator=torch.Generator().manual_seed(0))
    kept = got.keep.float()
    token_mean = agg_loss(loss, kept, "token-mean")
    assert float(token_mean) == pytest.approx(float(loss[got.keep].sum() / got.keep.sum()), rel=1e-6)
    seq_mean = agg_loss(loss, kept, "seq-mean-token-mean")
    want = sum(float(loss[i][got.keep[i]].mean()) for i in range(ROWS) if rows_kept[i]) / int(rows_kept.sum())
    assert float(seq_mean) == pytest.approx(want, rel=1e-6)
    # the rejected rows' values change nothing
    poisoned = torch.where(rows_kept.unsqueeze(-1), loss, torch.full_like(loss, 1e6))
    assert float(agg_loss(poisoned, kept, "seq-mean-token-mean")) == pytest.approx(float(seq_mean), rel=1e-6)


@pytest.mark.parametrize("level", [None, *IS_LEVELS.names()])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_on_policy_weights_are_one_and_nothing_is_rejected(level, mode) -> None:
    """Behaviour == trainer: whatever the level, mode and bounds that can hold (they hold 1), and every criterion
    at once with tight thresholds."""
    _, behaviour, mask = multi_turn(seed=8)
    cfg = RolloutCorrectionConfig(
        rollout_is=level, rollout_is_threshold="0.99_1.01", rollout_is_mode=mode,
        rollout_rs=",".join(RS_CRITERIA), rollout_rs_threshold=",".join("0.999_1.001" if c.endswith("k1") else "1e-9"
                                                                         for c in RS_CRITERIA),
    )  # fmt: skip
    got = apply_correction(cfg, proximal=behaviour, behaviour=behaviour, trainer=behaviour, mask=mask)
    assert torch.equal(got.keep, mask.bool())
    assert torch.equal(got.weights, mask)
    metrics = rollout_diagnostics(behaviour, behaviour, mask, got)
    assert metrics["kl_k1"] == 0 and metrics["kl_k3"] == 0 and metrics["log_ppl_diff"] == 0
    assert metrics["chi2_token"] == pytest.approx(0, abs=1e-12) and metrics["chi2_seq"] == pytest.approx(0, abs=1e-12)
    assert metrics["ess"] == pytest.approx(1.0) and metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    assert metrics["rejected_token_share"] == 0 and metrics["rejected_seq_share"] == 0
    assert metrics["is_weight_mean"] == metrics["is_weight_max"] == metrics["is_weight_min"] == 1.0


def test_decoupled_and_bypass_agree_on_policy() -> None:
    """Bypass (the engine's log-probs as proximal, the current forward's as trainer) and decoupled (the trainer's
    as both) give the same correction when the trainer's log-probs are the engine's."""
    _, behaviour, mask = multi_turn(seed=9)
    cfg = RolloutCorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=1e-6)
    decoupled = apply_correction(cfg, proximal=behaviour, behaviour=behaviour, trainer=behaviour, mask=mask)
    bypass = apply_correction(cfg, proximal=behaviour, behaviour=behaviour, trainer=behaviour.clone(), mask=mask)
    assert torch.equal(decoupled.keep, bypass.keep) and torch.equal(decoupled.weights, bypass.weights)


def test_diagnostics_follow_their_formulas() -> None:
    trainer, behaviour, mask = multi_turn(seed=10)
    delta = log_ratio_of(trainer, behaviour)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.2, rollout_rs="token_k2",
                                  rollout_rs_threshold=0.02)  # fmt: skip
    correction = apply_correction(cfg, proximal=trainer, behaviour=behaviour, trainer=trainer, mask=mask)
    got = rollout_diagnostics(trainer, behaviour, mask, correction)
    rows = [i for i in range(ROWS) if mask[i].any()]
    d = [float(delta[i, t]) for i in rows for t in tokens_of(mask, i)]
    rho = [math.exp(x) for x in d]
    n = len(d)
    want = {
        "kl_k1": sum(-x for x in d) / n,
        "kl_k3": sum(math.exp(x) - 1 - x for x in d) / n,
        "chi2_token": sum(r * r for r in rho) / n - 1,
        "chi2_seq": sum(math.exp(2 * sum(float(delta[i, t]) for t in tokens_of(mask, i))) for i in rows) / len(rows)
        - 1,
        "log_ppl_diff": sum(
            sum(float(behaviour[i, t]) for t in tokens_of(mask, i)) / len(tokens_of(mask, i))
            - sum(float(trainer[i, t]) for t in tokens_of(mask, i)) / len(tokens_of(mask, i))
            for i in rows
        )
        / len(rows),
        "ess": sum(rho) ** 2 / (n * sum(r * r for r in rho)),
        "ratio_mean": sum(rho) / n,
        "ratio_max": max(rho),
        "ratio_min": min(rho),
    }
    kept = [(i, t) for i in rows for t in tokens_of(mask, i) if 0.5 * float(delta[i, t]) ** 2 <= 0.02]
    w = [min(math.exp(float(delta[i, t])), 1.2) for i, t in kept]
    want |= {
        "rejected_token_share": 1 - len(kept) / n,
        "rejected_seq_share": sum(1 for i in rows if not any(j == i for j, _ in kept)) / len(rows),
        "is_weight_mean": sum(w) / len(w),
        "is_weight_max": max(w),
        "is_weight_min": min(w),
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert 0 < got["rejected_token_share"] < 1 and got["is_weight_max"] == pytest.approx(1.2)


def test_applied_sums_add_up_over_shards() -> None:
    trainer, behaviour, mask = multi_turn(seed=11)
    cfg = RolloutCorrectionConfig(rollout_rs="seq_mean_k2", rollout_rs_threshold=0.04)
    whole = applied_sums(apply_correction(cfg, proximal=trainer, behaviour=behaviour, trainer=trainer, mask=mask), mask)
    parts = [
        applied_sums(
            apply_correction(cfg, proximal=trainer[s], behaviour=behaviour[s], trainer=trainer[s], mask=mask[s]),
            mask[s],
        )
        for s in (slice(0, 2), slice(2, None))
    ]
    for key in ("tokens", "rows", "kept_tokens", "rejected_rows", "weight"):
        assert float(whole[key]) == pytest.approx(sum(float(p[key]) for p in parts)), key


def test_a_response_sampled_across_two_versions_is_corrected_token_by_token() -> None:
    """A response that lived through an in-flight update: its first tokens sampled by version 3, the rest by 4,
    each with its own engine log-prob on the wire. The trainer (version 4's weights) agrees with the tokens of 4;
    each token is weighed by its own ratio: 1 for version 4's, π_4 / π_3 for version 3's, not one ratio for all."""
    engine = [-1.0, -2.0, -0.5, -1.5, -0.7, -0.9]  # as sampled: tokens 0-2 by version 3, 3-5 by version 4
    sample = controller_pb2.Sample(
        prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5, 6, 7, 8, 9], rollout_logprobs=engine,
        policy_version=3, token_versions=[3, 3, 3, 4, 4, 4], group=0,
    )  # fmt: skip
    batch = to_train_batch([sample], pad_token_id=0, version=4)
    span = batch.response_mask.bool()
    trainer = batch.rollout_logprobs.clone()
    trainer[span] = torch.tensor([-0.8, -1.9, -0.9, -1.5, -0.7, -0.9])  # version 4 on the same tokens
    assert batch.token_versions[span].tolist() == [3, 3, 3, 4, 4, 4]
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=5.0)
    got = apply_correction(cfg, proximal=trainer, behaviour=batch.rollout_logprobs, trainer=trainer,
                           mask=batch.response_mask)  # fmt: skip
    want = [math.exp(0.2), math.exp(0.1), math.exp(-0.4), 1.0, 1.0, 1.0]
    assert got.weights[span].tolist() == pytest.approx(want, rel=1e-6)
