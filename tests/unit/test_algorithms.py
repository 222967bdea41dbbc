"""Unit tests for relayrl.algorithms, against values worked out by hand (arithmetic in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    DynamicSamplingExhausted,
    GroupFiller,
    Registry,
    agg_loss,
    compute_advantages,
    group_is_informative,
    kl_penalty,
    overlong_penalty,
    ppo_clip_loss,
)


def t(*rows: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=dtype)


def close(actual: torch.Tensor, expected: list[float] | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- registry


def test_registry_register_get_names() -> None:
    reg: Registry[object] = Registry("widget")

    @reg.register("b")
    def b() -> int:
        return 2

    @reg.register("a")
    def a() -> int:
        return 1

    assert reg.get("a") is a and reg.get("b")() == 2
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg


def test_registry_unknown_name_lists_known() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("alpha")(1)
    reg.register("beta")(2)
    with pytest.raises(KeyError) as ei:
        reg.get("gamma")
    msg = str(ei.value)
    assert "gamma" in msg and "alpha" in msg and "beta" in msg and "widget" in msg


def test_registry_duplicate_name_rejected() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(2)


def test_builtin_registries_names() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == ["distill", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    assert POLICY_LOSSES.names() == ["gspo", "ppo_clip"]
    assert set(LOSS_AGGREGATIONS.names()) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


# -------------------------------------------------------------------------------------------- advantages


def test_grpo_group_normalised_and_identical_group_is_zero() -> None:
    # ids are not contiguous and the groups are interleaved.
    # group 10: [1, 0, 1, 0] -> mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.577350
    #           A = ±0.5 / 0.577350 = ±0.866025
    # group 3:  [5, 5, 5] -> exactly 0
    rewards = t([1.0, 5.0, 0.0, 5.0, 1.0, 0.0, 5.0])
    gids = t([10, 3, 10, 3, 10, 10, 3], dtype=torch.int64)
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, gids, eps=0.0)
    close(adv, [0.866025, 0.0, -0.866025, 0.0, 0.866025, -0.866025, 0.0])
    assert adv.dtype == torch.float32
    assert torch.equal(adv[[1, 3, 6]], torch.zeros(3))


def test_grpo_eps_in_denominator() -> None:
    # group [0, 2, 4]: mean 2, std = sqrt((4+0+4)/2) = 2; eps = 1 -> A = (r-2)/3 = [-2/3, 0, 2/3]
    adv = compute_advantages("grpo", t([0.0, 2.0, 4.0]), t([0, 0, 0], dtype=torch.int64), eps=1.0)
    close(adv, [-2 / 3, 0.0, 2 / 3])


def test_grpo_vs_dr_grpo() -> None:
    # group 0: [0, 2, 4] -> mean 2, std 2 -> GRPO [-1, 0, 1]; Dr.GRPO (no std) [-2, 0, 2]
    # group 1: [0, 1, 2] -> mean 1, std 1 -> GRPO [-1, 0, 1]; Dr.GRPO [-1, 0, 1]
    rewards = t([0.0, 2.0, 4.0, 0.0, 1.0, 2.0])
    gids = t([0, 0, 0, 1, 1, 1], dtype=torch.int64)
    close(compute_advantages("grpo", rewards, gids, eps=0.0), [-1, 0, 1, -1, 0, 1])
    close(compute_advantages("grpo", rewards, gids, norm_by_std=False), [-2, 0, 2, -1, 0, 1])


def test_grpo_singleton_group_mean0_std1() -> None:
    # verl: a singleton gets mean 0 and std 1 -> A = r / (1 + eps) = 3 with eps 0
    adv = compute_advantages("grpo", t([3.0, 1.0, 0.0]), t([9, 1, 1], dtype=torch.int64), eps=0.0)
    # group 1: [1, 0] -> mean 0.5, std = sqrt(0.5) = 0.707107 -> ±0.707107
    close(adv, [3.0, 0.707107, -0.707107])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identical_group_rewards_give_exact_zero(name: str, norm_by_std: bool, dtype: torch.dtype) -> None:
    # In float64, 0.1 + 0.1 + 0.1 = 0.30000000000000004 and /3 != 0.1: a naive r - mean leaves a
    # ~1e-17 residue that std-normalisation would blow up. The result must be exactly 0 anyway.
    rewards = t([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.3, 0.9], dtype=dtype)
    gids = t([0, 0, 0, 1, 1, 1, 2, 2], dtype=torch.int64)
    adv = compute_advantages(name, rewards, gids, norm_by_std=norm_by_std)
    assert adv.dtype == dtype
    assert torch.equal(adv[:6], torch.zeros(6, dtype=dtype))
    assert (adv[6:] != 0).all()


def test_rloo_leave_one_out() -> None:
    # group 0: [1, 0, 0, 1]: A_0 = 1 - mean(0,0,1) = 1 - 1/3 = 2/3; A_1 = 0 - mean(1,0,1) = -2/3
    # group 1: [0, 2, 4]: A = [0 - 3, 2 - 2, 4 - 1] = [-3, 0, 3]  (= 3/2 · (r - 2))
    # group 2: singleton -> 0
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 4.0, 7.0])
    gids = t([0, 0, 0, 0, 1, 1, 1, 2], dtype=torch.int64)
    adv = compute_advantages("rloo", rewards, gids)
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -3.0, 0.0, 3.0, 0.0])
    assert adv[7].item() == 0.0


def test_reinforce_pp_whitens_over_batch() -> None:
    # [0, 1, 2, 3]: mean 1.5, unbiased var = (2.25+0.25+0.25+2.25)/3 = 5/3, std = 1.290994
    # A = [-1.5, -0.5, 0.5, 1.5] / 1.290994 = [-1.161895, -0.387298, 0.387298, 1.161895]; groups ignored
    rewards = t([0.0, 1.0, 2.0, 3.0])
    gids = t([0, 0, 1, 1], dtype=torch.int64)
    close(compute_advantages("reinforce_pp", rewards, gids, eps=0.0), [-1.161895, -0.387298, 0.387298, 1.161895])
    close(compute_advantages("reinforce_pp", rewards, gids, norm_by_std=False), [-1.5, -0.5, 0.5, 1.5])
    same = compute_advantages("reinforce_pp", t([0.1, 0.1, 0.1]), t([0, 1, 2], dtype=torch.int64))
    assert torch.equal(same, torch.zeros(3))


def test_reinforce_pp_baseline() -> None:
    # groups: g0 [0, 2] -> x = [-1, 1]; g1 [1, 5] -> x = [-2, 2]; g2 [3, 3] -> x = [0, 0]
    # batch mean of x = 0; unbiased var = (1+1+4+4+0+0)/5 = 2; std = 1.414214
    # A = x / 1.414214 = [-0.707107, 0.707107, -1.414214, 1.414214, 0, 0]
    rewards = t([0.0, 2.0, 1.0, 5.0, 3.0, 3.0])
    gids = t([0, 0, 1, 1, 2, 2], dtype=torch.int64)
    adv = compute_advantages("reinforce_pp_baseline", rewards, gids, eps=0.0)
    close(adv, [-0.707107, 0.707107, -1.414214, 1.414214, 0.0, 0.0])
    close(compute_advantages("reinforce_pp_baseline", rewards, gids, norm_by_std=False), [-1, 1, -2, 2, 0, 0])


def test_advantage_input_validation() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", t([1.0, 2.0]), t([0, 0, 0], dtype=torch.int64))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", t([1.0, 2.0]), t([0.0, 0.0]))
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages("grpo", t([1.0, float("nan")]), t([0, 0], dtype=torch.int64))
    with pytest.raises(KeyError, match="vtrace"):
        compute_advantages("vtrace", t([1.0]), t([0], dtype=torch.int64))
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_advantages("gae", t([1.0]), t([0], dtype=torch.int64))
    with pytest.raises(ValueError, match="distill needs the teacher's log-probs"):
        compute_advantages("distill", t([1.0]), t([0], dtype=torch.int64))


def test_advantage_empty_batch() -> None:
    for name in set(ADVANTAGE_ESTIMATORS.names()) - {"gae", "distill"}:  # token advantages, their own inputs
        out = compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.int64))
        assert out.shape == (0,)


# ------------------------------------------------------------------------------------------- policy loss


def _one(ratio: float, adv: float, **kw: object) -> tuple[float, dict[str, torch.Tensor]]:
    """ppo_clip on a single token with the given ratio (old_logprob = 0, logprob = log ratio)."""
    lp = torch.tensor([[math.log(ratio)]])
    loss, m = ppo_clip_loss(lp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), **kw)
    return loss.item(), m


def test_clip_higher_asymmetry_positive_advantage() -> None:
    # A = 1, ratio 1.25. clip_high 0.28: clip(1.25, 0.8, 1.28) = 1.25 -> pg1 = pg2 = -1.25, not clipped
    loss, m = _one(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25, abs=1e-6)
    assert m["clip_frac"].item() == 0.0
    # clip_high 0.2: pg2 = -1·1.2 = -1.2 > pg1 = -1.25 -> loss = -1.2, clipped
    loss, m = _one(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert m["clip_frac"].item() == 1.0 and m["clip_frac_high"].item() == 1.0
    assert m["clip_frac_low"].item() == 0.0


def test_clip_low_negative_advantage() -> None:
    # A = -1, ratio 0.75: pg1 = 0.75, pg2 = 1·clip(0.75, 0.8, 1.28) = 0.8 -> loss = max = 0.8
    loss, m = _one(0.75, -1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(0.8, abs=1e-6)
    assert m["clip_frac"].item() == 1.0 and m["clip_frac_low"].item() == 1.0
    # A = +1, ratio 0.75: pg1 = -0.75 > pg2 = -0.8 -> loss = -0.75, not clipped (PPO is pessimistic)
    loss, m = _one(0.75, 1.0)
    assert loss == pytest.approx(-0.75, abs=1e-6)
    assert m["clip_frac"].item() == 0.0


def test_dual_clip_caps_negative_advantage() -> None:
    # A = -2, ratio e^10 = 22026.47: pg1 = 44052.93, pg2 = 2·1.28 = 2.56, max = 44052.93;
    # dual-clip: min(44052.93, -A·clip_c = 2·3 = 6) = 6
    loss, m = _one(math.exp(10.0), -2.0, clip_c=3.0)
    assert loss == pytest.approx(6.0, abs=1e-5)
    assert m["dual_clip_frac"].item() == 1.0
    # disabled: the unbounded pg1 remains
    loss, m = _one(math.exp(10.0), -2.0, clip_c=None)
    assert loss == pytest.approx(2 * math.exp(10.0), rel=1e-5)
    assert m["dual_clip_frac"].item() == 0.0
    # A = -1, ratio 2 < clip_c = 3: pg1 = 2, pg2 = 1.28 -> 2 (dual-clip not active)
    loss, m = _one(2.0, -1.0, clip_c=3.0)
    assert loss == pytest.approx(2.0, abs=1e-6)
    assert m["dual_clip_frac"].item() == 0.0
    # A > 0 is never dual-clipped: A = 1, ratio e^10 -> pg2 = -1.28 > pg1 -> -1.28
    loss, _ = _one(math.exp(10.0), 1.0, clip_c=3.0)
    assert loss == pytest.approx(-1.28, abs=1e-6)


def test_log_ratio_clamped_before_exp() -> None:
    # logprob - old = 50 -> clamped to 20; A = -1, no dual clip: loss = e^20 = 4.85165e8 (not inf)
    lp = torch.tensor([[50.0]])
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_c=None)
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_is_weights_scale_loss() -> None:
    # A = 1, ratio 1 -> loss -1; times IS weight 0.5 -> -0.5
    lp = torch.zeros(1, 2)
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = ppo_clip_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2), is_weights=w)
    close(loss, [[-0.5, -2.0]])


def test_ppo_metrics_are_masked_means() -> None:
    # row 0: (A=1, r=1.25, clip_high=0.2 -> clipped high), (A=-1, r=0.75 -> clipped low), (A=1, r=1 -> no)
    # row 1: (A=-1, r=e^2=7.39 > clip_c=3 -> dual-clipped), (masked: A=-1, r=0.5 would be clipped low), pad
    # valid tokens: 4 -> clip_frac = 2/4, clip_frac_low = 1/4, clip_frac_high = 1/4, dual_clip_frac = 1/4
    # approx_kl = mean(old - new) = -(log1.25 + log0.75 + 0 + 2)/4 = -(0.223144 - 0.287682 + 2)/4 = -0.483866
    lp = torch.log(torch.tensor([[1.25, 0.75, 1.0], [math.exp(2.0), 0.5, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    _, m = ppo_clip_loss(lp, torch.zeros(2, 3), adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["clip_frac_low"].item() == pytest.approx(0.25)
    assert m["clip_frac_high"].item() == pytest.approx(0.25)
    assert m["dual_clip_frac"].item() == pytest.approx(0.25)
    assert m["approx_kl"].item() == pytest.approx(-0.483866, abs=1e-5)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_ppo_clip_gradient_zero_for_clipped_tokens() -> None:
    # d loss / d logprob where the unclipped branch -A·ratio is active = -A·ratio; 0 where clipped.
    # tok0: A=1, r=1.25, clip_high=0.2 -> clipped high   -> 0
    # tok1: A=-1, r=0.75                -> clipped low    -> 0
    # tok2: A=-1, r=e^2 > clip_c=3      -> dual-clipped   -> 0
    # tok3: A=1, r=1.1 (inside)         -> -1·1.1 = -1.1
    # tok4: A=-1, r=0.9 (inside)        -> +0.9
    # tok5: A=1, r=0.5 (below, A>0: pg1 kept) -> -0.5
    ratios = torch.tensor([[1.25, 0.75, math.exp(2.0), 1.1, 0.9, 0.5]], dtype=torch.float64)
    lp = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 6)
    loss, _ = ppo_clip_loss(lp, torch.zeros_like(lp), adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    loss.sum().backward()
    assert lp.grad is not None
    close(lp.grad, [[0.0, 0.0, 0.0, -1.1, 0.9, -0.5]], atol=1e-9)
    assert torch.equal(lp.grad[0, :3], torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_c": 1.0}, "clip_c"),
        ({"clip_c": 0.5}, "clip_c"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -0.01}, "clip_high"),
        ({"clip_high": float("nan")}, "clip_high"),
    ],
)
def test_ppo_clip_validation(kwargs: dict[str, float], field: str) -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=field):
        ppo_clip_loss(z, z, z, torch.ones(1, 2), **kwargs)


def test_ppo_clip_shape_validation() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(z, z, torch.zeros(2), torch.ones(2, 3))


# ------------------------------------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_agg_token_mean() -> None:
    # (1 + 2 + 4) / 3 tokens = 7/3; with global num_tokens = 14: 7/14 = 0.5
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=14).item() == pytest.approx(0.5)


def test_agg_seq_mean_token_sum() -> None:
    # rows: 1+2 = 3, 4 -> (3 + 4) / 2 = 3.5; num_seqs = 7: 7/7 = 1
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)


def test_agg_seq_mean_token_mean() -> None:
    # row means: (1+2)/2 = 1.5, 4/1 = 4 -> (1.5 + 4) / 2 = 2.75; num_seqs = 4: 5.5/4 = 1.375
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", num_seqs=4).item() == pytest.approx(1.375)
    # an empty row contributes 0 and is not counted: 1.5 / 1 = 1.5
    empty_row = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert agg_loss(LOSS, empty_row, "seq-mean-token-mean").item() == pytest.approx(1.5)


def test_agg_seq_mean_token_sum_norm() -> None:
    # (1 + 2 + 4) / (2 seqs · 3 = T) = 7/6; norm_len = 7, num_seqs = 1: 7/7 = 1
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=1, norm_len=7).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_ignores_garbage_at_masked_positions(mode: str) -> None:
    dirty = LOSS.clone()
    dirty[0, 2] = float("nan")
    dirty[1, 1] = float("inf")
    assert agg_loss(dirty, MASK, mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())
    # a float 0/1 mask gives the same as the bool mask
    assert agg_loss(LOSS, MASK.float(), mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())


def test_agg_empty_mask_is_zero_not_nan() -> None:
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in LOSS_AGGREGATIONS.names():
        assert agg_loss(LOSS, empty, mode).item() == 0.0


def test_agg_unknown_mode_and_bad_counts() -> None:
    with pytest.raises(KeyError, match="token-median"):
        agg_loss(LOSS, MASK, "token-median")
    with pytest.raises(ValueError, match="num_tokens"):
        agg_loss(LOSS, MASK, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="mask"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


def test_agg_gradient_flows_only_to_valid_tokens() -> None:
    # token-mean over 3 valid tokens: d/dloss = 1/3 at valid positions, 0 elsewhere
    x = LOSS.clone().requires_grad_(True)
    agg_loss(x, MASK, "token-mean").backward()
    assert x.grad is not None
    close(x.grad, [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]])


# --------------------------------------------------------------------------------------------------- KL


def test_kl_estimators() -> None:
    # lp - ref = +1: k1 = 1, k2 = 0.5, k3 = e^-1 - (-1) - 1 = e^-1 = 0.367879
    # lp - ref = -1: k1 = -1, k2 = 0.5, k3 = e^1 - 1 - 1 = 0.718282
    # lp = ref: all 0
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])
    close(kl_penalty(lp, ref, "k1"), [1.0, -1.0, 0.0])
    close(kl_penalty(lp, ref, "k2"), [0.5, 0.5, 0.0])
    close(kl_penalty(lp, ref, "k3"), [0.367879, 0.718282, 0.0])


def test_kl_k3_clamped() -> None:
    # ref - lp = 30: e^20 - 20 - 1 is huge -> clamped to 10; stays finite
    out = kl_penalty(torch.tensor([-40.0]), torch.tensor([-10.0]), "k3")
    assert out.item() == 10.0


def test_kl_unknown_kind() -> None:
    with pytest.raises(KeyError, match="k4"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ---------------------------------------------------------------------------------------------- overlong


def test_overlong_penalty_regions() -> None:
    # Lmax = 100, Lcache = 20 -> expected length 80
    assert overlong_penalty(50, 100, 20) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0  # boundary: L <= Lmax - Lcache
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)  # (80 - 90) / 20
    assert overlong_penalty(85, 100, 20, penalty_factor=2.0) == pytest.approx(-0.5)  # (80-85)/20·2
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)  # (80 - 100) / 20
    assert overlong_penalty(101, 100, 20) == -1.0
    assert overlong_penalty(5000, 100, 20, penalty_factor=0.5) == -0.5
    # no buffer: 0 up to Lmax, then -factor
    assert overlong_penalty(100, 100, 0) == 0.0
    assert overlong_penalty(101, 100, 0) == -1.0


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((10, 100, 120), "buffer_len"),
        ((10, 100, -1), "buffer_len"),
        ((10, 0, 0), "max_response_len"),
        ((-1, 100, 20), "response_len"),
        ((10, 100, 20, -1.0), "penalty_factor"),
    ],
)
def test_overlong_penalty_validation(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        overlong_penalty(*args)


# -------------------------------------------------------------------------------------- dynamic sampling


def test_group_is_informative() -> None:
    assert group_is_informative([0.0, 1.0])
    assert not group_is_informative([1.0, 1.0, 1.0])
    assert not group_is_informative([0.5])
    assert not group_is_informative([])
    assert not group_is_informative([0.0, 0.05], tol=0.1)
    with pytest.raises(ValueError, match="rewards"):
        group_is_informative([0.0, float("nan")])


def test_group_filler_fills_across_batches() -> None:
    filler: GroupFiller[str] = GroupFiller(target_groups=3, max_gen_batches=3)
    # batch 1: a all-equal, b mixed, c all-equal -> keep [b]
    assert filler.add_batch(["a", "b", "c"], [[1, 1], [0, 1], [0, 0]]) == ["a", "c"]
    assert filler.kept == ["b"] and not filler.is_full and filler.gen_batches == 1
    # batch 2: d mixed, e all-equal -> keep [b, d]
    assert filler.add_batch(["d", "e"], [[1, 0], [1, 1]]) == ["e"]
    assert not filler.is_full
    # batch 3 (the last allowed): f, g mixed -> kept [b, d, f, g] = 4 >= 3, full, no error
    assert filler.add_batch(["f", "g"], [[0, 1], [1, 0.5]]) == []
    assert filler.is_full and filler.dropped_count == 3 and filler.gen_batches == 3
    assert filler.take() == ["b", "d", "f"]
    assert filler.surplus == ["g"]


def test_group_filler_raises_clear_message_when_exhausted() -> None:
    filler: GroupFiller[int] = GroupFiller(target_groups=4, max_gen_batches=2)
    filler.add_batch([1, 2], [[1, 1], [0, 1]])  # keeps 2, drops 1
    with pytest.raises(DynamicSamplingExhausted) as ei:
        filler.add_batch([3, 4], [[0, 0], [0.5, 0.5]])  # drops 2 -> kept 1/4 after 2 batches
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert (err.kept, err.target, err.gen_batches, err.dropped) == (1, 4, 2, 3)
    msg = str(err)
    assert "kept 1 of 4" in msg
    assert "after 2 generation batches" in msg
    assert "3 groups were dropped because all their rewards were equal" in msg
    assert "max_gen_batches" in msg and "generation batch" in msg and "reward function" in msg
    with pytest.raises(DynamicSamplingExhausted):
        filler.check_exhausted()
    assert filler.take(partial=True) == [2]  # controller.on_exhausted: partial trains on what was kept


def test_group_filler_disabled_keeps_everything() -> None:
    filler: GroupFiller[str] = GroupFiller(target_groups=2, max_gen_batches=1, enabled=False)
    assert filler.add_batch(["a", "b", "c"], [[1, 1], [0, 0], [0, 1]]) == []
    assert filler.dropped_count == 0
    assert filler.take() == ["a", "b"] and filler.surplus == ["c"]


def test_group_filler_take_before_full_and_validation() -> None:
    filler: GroupFiller[str] = GroupFiller(target_groups=2, max_gen_batches=5)
    filler.add_batch(["a"], [[0, 1]])
    with pytest.raises(RuntimeError, match="1 of 2"):
        filler.take()
    with pytest.raises(ValueError, match="rewards"):
        filler.add_batch(["a", "b"], [[0, 1]])
    with pytest.raises(ValueError, match="target_groups"):
        GroupFiller(target_groups=0, max_gen_batches=1)
    with pytest.raises(ValueError, match="max_gen_batches"):
        GroupFiller(target_groups=1, max_gen_batches=0)
