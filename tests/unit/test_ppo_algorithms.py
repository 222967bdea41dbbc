"""GAE, the clipped value loss and GSPO against references written from their formulas (per row, over the policy's
tokens only, by explicit sums rather than the implementation's masked recursion) and from verl's core_algos as
read, on random inputs whose masks have a prompt, multi-turn observation gaps and padding."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms import POLICY_LOSSES, agg_loss
from relayrl.algorithms.gae import gae_advantages, masked_whiten, terminal_rewards
from relayrl.algorithms.policy_loss import gspo_loss
from relayrl.algorithms.value_loss import clipped_value_loss, explained_variance

TOL = 1e-6


def multi_turn_mask(gen: torch.Generator, rows: int = 6, length: int = 40) -> torch.Tensor:
    """Per row: a prompt (0s), 1 to 3 policy turns separated by observation tokens (0s), then padding (0s); one
    row has no policy token at all."""
    mask = torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows - 1):
        t = int(torch.randint(1, 6, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            n = int(torch.randint(1, 6, (1,), generator=gen))
            mask[i, t : min(t + n, length)] = 1
            t += n + int(torch.randint(1, 5, (1,), generator=gen))
            if t >= length:
                break
    return mask


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    mask = multi_turn_mask(gen)
    rewards = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values[mask == 0] = 1e3  # garbage where the mask is 0: it must not leak in
    return mask, rewards, values


def reference_gae(rewards, values, mask, gamma, lam):
    """From the formula, row by row over the policy tokens t_1..t_n: δ_k = r_k + γ V_{k+1} − V_k (V_{n+1} = 0),
    A_k = Σ_{l ≥ k} (γλ)^{l−k} δ_l; R_k = A_k + V_k. The reward sits on the last policy token."""
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    for i in range(mask.shape[0]):
        pos = torch.nonzero(mask[i]).flatten().tolist()
        n = len(pos)
        v = [float(values[i, p]) for p in pos] + [0.0]
        r = [0.0] * n
        if n:
            r[-1] = float(rewards[i])
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
        for k, p in enumerate(pos):
            a = sum((gamma * lam) ** (j - k) * delta[j] for j in range(k, n))
            adv[i, p] = a
            ret[i, p] = a + v[k]
    return adv, ret


def verl_style_gae(token_rewards, values, mask, gamma, lam):
    """As verl's compute_gae_advantage_return reads: one backward pass over all positions, where a masked position
    keeps the next value and the running advantage of the token after it (no whitening here)."""
    next_v = torch.zeros(mask.shape[0], dtype=torch.float64)
    last = torch.zeros(mask.shape[0], dtype=torch.float64)
    out = []
    for t in reversed(range(mask.shape[1])):
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        cand = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = cand * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_the_formula_and_verl_over_multi_turn_masks(gamma, lam, seed):
    mask, rewards, values = inputs(seed)
    tok = terminal_rewards(rewards, mask)
    adv, ret = gae_advantages(tok, values, mask, gamma=gamma, lam=lam, whiten=False)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, ref_adv, atol=TOL, rtol=0)
    assert torch.allclose(ret, ref_ret, atol=TOL, rtol=0)
    clean = torch.where(mask != 0, values, torch.zeros_like(values))  # verl's inputs hold no garbage
    verl_adv, verl_ret = verl_style_gae(tok, clean, mask, gamma, lam)
    on = mask != 0
    assert torch.allclose(adv[on], verl_adv[on], atol=TOL, rtol=0)
    assert torch.allclose(ret[on], verl_ret[on], atol=TOL, rtol=0)
    assert not adv[~on].any() and not ret[~on].any()


def test_gae_with_gamma_lambda_one_is_monte_carlo():
    mask, rewards, values = inputs(3)
    adv, ret = gae_advantages(terminal_rewards(rewards, mask), values, mask, whiten=False)
    rows = rewards.unsqueeze(-1).expand_as(mask)
    on = mask != 0
    assert torch.allclose(adv[on], (rows - values)[on], atol=TOL, rtol=0)  # A_t = R - V(s_t)
    assert torch.allclose(ret[on], rows[on], atol=TOL, rtol=0)  # every token's return is the outcome


def test_whitened_gae_equals_the_whitened_reference():
    mask, rewards, values = inputs(4)
    adv, _ = gae_advantages(terminal_rewards(rewards, mask), values, mask, gamma=1.0, lam=0.95, whiten=True)
    raw, _ = reference_gae(rewards, values, mask, 1.0, 0.95)
    on = mask != 0
    sel = raw[on]
    expected = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)
    assert torch.allclose(adv[on], expected, atol=TOL, rtol=0)
    assert not adv[~on].any()
    assert abs(float(adv[on].mean())) < TOL


def test_whitening_fewer_than_two_tokens_only_centres():
    x = torch.tensor([[3.0, 5.0]], dtype=torch.float64)
    assert masked_whiten(x, torch.tensor([[0.0, 1.0]], dtype=torch.float64)).tolist() == [[0.0, 0.0]]


def test_terminal_rewards_sit_on_the_last_policy_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    out = terminal_rewards(torch.tensor([2.0, 7.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 2.0, 0], [0] * 6]


def reference_value_loss(vpreds, old, returns, mask, c):
    """½ max((V − R)², (old + clip(V − old, −c, c) − R)²), token-mean over the policy tokens, written per token."""
    losses, clipped = [], []
    for i, j in torch.nonzero(mask).tolist():
        v, o, r = float(vpreds[i, j]), float(old[i, j]), float(returns[i, j])
        vc = min(max(v, o - c), o + c)
        losses.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
        clipped.append(float((vc - r) ** 2 > (v - r) ** 2))
    return sum(losses) / len(losses), sum(clipped) / len(clipped)


@pytest.mark.parametrize("c", [0.2, 0.5])
def test_clipped_value_loss_equals_the_formula(c):
    mask, rewards, old = inputs(5)
    old = torch.where(mask != 0, old, torch.zeros_like(old))
    gen = torch.Generator().manual_seed(6)
    vpreds = (old + 0.8 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    _, returns = gae_advantages(terminal_rewards(rewards, mask), old, mask, lam=0.9, whiten=False)
    loss, metrics = clipped_value_loss(vpreds, old, returns, mask, cliprange_value=c)
    ref_loss, ref_frac = reference_value_loss(vpreds.detach(), old, returns, mask, c)
    assert abs(float(loss.detach()) - ref_loss) < TOL
    assert abs(float(metrics["value_clip_frac"]) - ref_frac) < TOL
    assert 0 < ref_frac < 1  # both branches are exercised


def test_value_loss_over_pieces_with_global_counts_sums_to_the_whole():
    """verl PR #6957: a mini-batch cut into micro-batches (or rank shards) must give the gradient of the whole
    mini-batch's loss. With the mini-batch's global token count each piece's loss is its share; the per-piece
    normalisation (each by its own token count, averaged) is not the whole mini-batch's loss."""
    mask, rewards, old = inputs(7)
    old = torch.where(mask != 0, old, torch.zeros_like(old))
    vpreds = old + 0.3
    _, returns = gae_advantages(terminal_rewards(rewards, mask), old, mask, whiten=False)
    whole, _ = clipped_value_loss(vpreds, old, returns, mask, cliprange_value=0.5)
    tokens = float(mask.sum())
    pieces = [slice(0, 2), slice(2, 3), slice(3, 6)]
    shared = sum(
        float(clipped_value_loss(vpreds[s], old[s], returns[s], mask[s], cliprange_value=0.5, num_tokens=tokens)[0])
        for s in pieces
    )
    assert abs(shared - float(whole)) < TOL
    per_piece = sum(float(clipped_value_loss(vpreds[s], old[s], returns[s], mask[s])[0]) for s in pieces) / len(pieces)
    assert abs(per_piece - float(whole)) > 1e-3


def test_explained_variance():
    mask, rewards, _ = inputs(8)
    returns = terminal_rewards(rewards, mask) + mask * 0.5
    on = mask != 0
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    mean_only = torch.full_like(returns, float(returns[on].mean()))
    assert float(explained_variance(mean_only, returns, mask)) == pytest.approx(0.0, abs=TOL)
    noisy = returns + torch.randn(returns.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    r, e = returns[on], (returns - noisy)[on]
    expected = 1 - e.var(unbiased=False) / r.var(unbiased=False)
    assert float(explained_variance(noisy, returns, mask)) == pytest.approx(float(expected), abs=TOL)


def gspo_inputs(seed: int, noise: float = 4e-4):
    mask, rewards, _ = inputs(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
    logprob = (old + noise * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = rewards.unsqueeze(-1).expand_as(mask).contiguous()
    is_w = torch.rand(mask.shape, generator=gen, dtype=torch.float64) + 0.5
    return mask, logprob, old, adv, is_w


def reference_gspo(logprob, old, adv, mask, lo, hi, is_w):
    """Per row: s_i = exp(mean over the policy tokens of (logprob − old)); the row's loss is the mean over its
    tokens of w_t · max(−A s_i, −A clip(s_i, 1 − lo, 1 + hi)); seq-mean-token-mean over rows with tokens. The
    gradient with respect to logprob_t, from GSPO-token: ∂/∂logprob_t (sg[s_i] π_t / sg[π_t]) = s_i, so an
    unclipped row gives −A s_i w_t / (|y_i| · rows) and a clipped one 0."""
    rows, total, grad = 0, 0.0, torch.zeros_like(logprob)
    for i in range(mask.shape[0]):
        pos = torch.nonzero(mask[i]).flatten().tolist()
        if not pos:
            continue
        rows += 1
        s = float(torch.exp(sum(logprob[i, p] - old[i, p] for p in pos) / len(pos)))
        a = float(adv[i, pos[0]])
        unclipped = -a * s
        clipped = -a * min(max(s, 1 - lo), 1 + hi)
        row_loss = max(unclipped, clipped)
        total += sum(float(is_w[i, p]) * row_loss for p in pos) / len(pos)
        if unclipped >= clipped:
            for p in pos:
                grad[i, p] = -a * s * float(is_w[i, p]) / len(pos)
    return total / rows, grad / rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lo,hi", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_loss_and_its_gradient_equal_the_sequence_formula(seed, lo, hi):
    mask, logprob, old, adv, is_w = gspo_inputs(seed)
    loss_mat, metrics = gspo_loss(logprob, old, adv, mask, clip_low=lo, clip_high=hi, is_weights=is_w)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean")
    loss.backward()
    ref_loss, ref_grad = reference_gspo(logprob.detach(), old, adv, mask, lo, hi, is_w)
    assert abs(float(loss.detach()) - ref_loss) < TOL
    assert torch.allclose(logprob.grad, ref_grad, atol=TOL, rtol=0)
    assert float(metrics["approx_kl"]) == pytest.approx(float(((old - logprob.detach()) * mask).sum() / mask.sum()))


def test_gspo_clips_whole_rows_and_is_registered():
    """The tight default clip (3e-4 / 4e-4) clips some rows and not others, every token of a row alike."""
    mask, logprob, old, adv, _ = gspo_inputs(1, noise=3e-3)
    loss_mat, metrics = POLICY_LOSSES.get("gspo")(logprob, old, adv, mask)
    agg_loss(loss_mat, mask, "seq-mean-token-mean").backward()
    on = mask != 0
    per_row = [bool(logprob.grad[i][on[i]].eq(0).all()) for i in range(mask.shape[0]) if on[i].any()]
    assert any(per_row) and not all(per_row)
    for i in range(mask.shape[0]):
        if on[i].any():
            assert logprob.grad[i][on[i]].eq(0).all() or logprob.grad[i][on[i]].ne(0).all()
    assert 0 < float(metrics["clip_frac"]) < 1


def test_gspo_config_takes_its_clip_range_and_aggregation_unless_given():
    from relayrl.config import AlgorithmConfig

    gspo = AlgorithmConfig(policy_loss="gspo")
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert AlgorithmConfig(policy_loss="gspo", clip_high=1e-3).clip_high == 1e-3
    assert AlgorithmConfig().clip_low == 0.2  # ppo_clip keeps its own
    with pytest.raises(ValueError, match="loss_agg: gspo"):
        AlgorithmConfig(policy_loss="gspo", loss_agg="token-mean")
