"""The offline and scoring losses (relayrl/algorithms: reward_loss, preference_loss, kto_loss, sft_loss, distill)
against their formulas, written out here element by element in Python floats, on random float64 batches: values and
gradients to 1e-6 (the gradients against the formulas' derivatives), masks respected."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import (
    PREFERENCE_LOSSES,
    REWARD_LOSSES,
    bradley_terry_loss,
    compute_preference_loss,
    distill_advantage,
    kto_loss,
    kto_reference_point,
    mean_reverse_kl,
    mismatched_completions,
    pack_examples,
    pad_examples,
    sequence_logprobs,
    sft_loss,
    token_accuracy,
    with_task_advantage,
)
from relayrl.models.tiny import build_model, build_tokenizer

TOL = 1e-6


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def close(actual: torch.Tensor, expected: list[float] | float) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[id] in float64 (``logprobs_from_logits`` computes in float32, the trainer's precision)."""
    return torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def leaf(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()


def test_registries_name_the_losses() -> None:
    assert REWARD_LOSSES.names() == ["bradley_terry"]
    assert PREFERENCE_LOSSES.names() == ["ipo", "sigmoid"]


# ------------------------------------------------------------------------------------------------ Bradley–Terry


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_values_and_gradients(with_margin: bool, center: float | None) -> None:
    rc, rr = leaf(6, seed=1), leaf(6, seed=2)
    margin = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) if with_margin else None
    loss, metrics = bradley_terry_loss(rc, rr, margin=margin, center_rewards_coefficient=center)
    loss.backward()
    c, b = center or 0.0, 6
    m = margin.tolist() if margin is not None else [0.0] * b
    pairs = list(zip(rc.tolist(), rr.tolist(), m))
    # L = mean −log σ(r_c − r_r − m) + c · mean (r_c + r_r)²
    expected = sum(-math.log(sig(x - y - k)) for x, y, k in pairs) / b + c * sum((x + y) ** 2 for x, y, _ in pairs) / b
    close(loss, expected)
    # dL/dr_c = (−σ(−(r_c − r_r − m)) + 2c (r_c + r_r)) / B;  dL/dr_r = (σ(−(r_c − r_r − m)) + 2c (r_c + r_r)) / B
    close(rc.grad, [(-sig(-(x - y - k)) + 2 * c * (x + y)) / b for x, y, k in pairs])
    close(rr.grad, [(sig(-(x - y - k)) + 2 * c * (x + y)) / b for x, y, k in pairs])
    close(metrics["accuracy"], sum(x > y for x, y, _ in pairs) / b)
    close(metrics["margin"], sum(x - y for x, y, _ in pairs) / b)
    close(metrics["mean_reward"], (sum(rc.tolist()) + sum(rr.tolist())) / (2 * b))
    close(metrics["min_reward"], min(rc.tolist() + rr.tolist()))
    close(metrics["max_reward"], max(rc.tolist() + rr.tolist()))


def test_bradley_terry_refuses_bad_shapes_naming_the_argument() -> None:
    two, three = torch.zeros(2), torch.zeros(3)
    with pytest.raises(ValueError, match="rejected_rewards: expected shape"):
        bradley_terry_loss(two, three)
    with pytest.raises(ValueError, match="margin: expected shape"):
        bradley_terry_loss(two, two, margin=three)
    with pytest.raises(ValueError, match="center_rewards_coefficient: must be >= 0"):
        bradley_terry_loss(two, two, center_rewards_coefficient=-1.0)
    with pytest.raises(ValueError, match="chosen_rewards: expected a 1-D tensor"):
        bradley_terry_loss(torch.zeros(0), torch.zeros(0))


# ------------------------------------------------------------------------------------- sequence log-probs


def test_sequence_logprobs_sum_completion_tokens_only() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0]])
    token_lp = token_logprobs(logits, labels)
    seq = sequence_logprobs(token_lp, mask)
    log_softmax = torch.log_softmax(logits.detach(), -1)
    expected = [sum(log_softmax[i, t, labels[i, t]].item() for t in range(7) if mask[i, t]) for i in range(3)]
    close(seq, expected)
    seq.sum().backward()
    assert (logits.grad[mask == 0] == 0).all()  # a masked token never counts: no gradient reaches its logits
    assert (logits.grad[mask == 1].abs().sum(-1) > 0).all()


def test_sequence_logprobs_ignore_garbage_at_masked_positions() -> None:
    lp = torch.tensor([[float("nan"), -1.0, -2.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    seq = sequence_logprobs(lp, torch.tensor([[0, 1, 1, 0]]))
    close(seq, [-3.0])
    seq.sum().backward()
    close(lp.grad, [[0.0, 1.0, 1.0, 0.0]])


# ----------------------------------------------------------------------------------------- DPO, cDPO, IPO


def dpo_batch(seed: int) -> tuple[torch.Tensor, ...]:
    return (
        leaf(5, seed=seed, scale=3.0),
        leaf(5, seed=seed + 1, scale=3.0),
        leaf(5, seed=seed + 2, scale=3.0),
        leaf(5, seed=seed + 3, scale=3.0),
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_dpo_sigmoid_and_conservative_dpo(label_smoothing: float) -> None:
    pc, pr, rc, rr = dpo_batch(10)
    beta, eps, b = 0.2, label_smoothing, 5
    loss, metrics = compute_preference_loss("sigmoid", pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    loss.mean().backward()
    rows = list(zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()))
    deltas = [(a - c) - (p - r) for a, p, c, r in rows]  # Δ = ρ_c − ρ_r
    # loss = −(1 − ε) log σ(βΔ) − ε log σ(−βΔ)
    close(loss, [-(1 - eps) * math.log(sig(beta * d)) - eps * math.log(sig(-beta * d)) for d in deltas])
    # dloss/dΔ = β (−(1 − ε) σ(−βΔ) + ε σ(βΔ)); Δ = π_c − ref_c − π_r + ref_r, the batch loss is the mean
    dldd = [beta * (-(1 - eps) * sig(-beta * d) + eps * sig(beta * d)) / b for d in deltas]
    close(pc.grad, dldd)
    close(pr.grad, [-g for g in dldd])
    close(rc.grad, [-g for g in dldd])
    close(rr.grad, dldd)
    chosen_rewards = [beta * (a - c) for a, _, c, _ in rows]
    rejected_rewards = [beta * (p - r) for _, p, _, r in rows]
    close(metrics["rewards/chosen"], sum(chosen_rewards) / b)
    close(metrics["rewards/rejected"], sum(rejected_rewards) / b)
    close(metrics["rewards/accuracies"], sum(x > y for x, y in zip(chosen_rewards, rejected_rewards)) / b)
    close(metrics["rewards/margins"], sum(x - y for x, y in zip(chosen_rewards, rejected_rewards)) / b)
    close(metrics["logps/chosen"], sum(pc.tolist()) / b)
    close(metrics["logps/rejected"], sum(pr.tolist()) / b)


def test_ipo_normalises_by_completion_length() -> None:
    pc, pr, rc, rr = dpo_batch(20)
    nc, nr = torch.tensor([3, 1, 7, 2, 5]), torch.tensor([4, 4, 1, 9, 2])
    beta, b = 0.5, 5
    loss, metrics = PREFERENCE_LOSSES.get("ipo")(pc, pr, rc, rr, beta=beta, chosen_tokens=nc, rejected_tokens=nr)
    loss.mean().backward()
    rows = list(zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), nc.tolist(), nr.tolist()))
    h = [(a - c) / m - (p - r) / n for a, p, c, r, m, n in rows]  # h = ρ_c / n_c − ρ_r / n_r
    close(loss, [(x - 1 / (2 * beta)) ** 2 for x in h])  # (h − 1/(2β))²
    dldh = [2 * (x - 1 / (2 * beta)) / b for x in h]
    close(pc.grad, [g / m for g, (_, _, _, _, m, _) in zip(dldh, rows)])
    close(pr.grad, [-g / n for g, (_, _, _, _, _, n) in zip(dldh, rows)])
    close(metrics["rewards/margins"], sum(beta * ((a - c) - (p - r)) for a, p, c, r, _, _ in rows) / b)


def test_dpo_gradient_reaches_completion_tokens_only() -> None:
    """DPO through ``sequence_logprobs``: the token log-probs' gradient is dL/dlogp_seq on completion tokens, 0 on
    prompt and padding positions (which hold garbage here)."""
    g = torch.Generator().manual_seed(5)
    token_lp = (-torch.rand(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    garbage = torch.where(mask == 1, token_lp, torch.full_like(token_lp, float("nan")))
    seq = sequence_logprobs(garbage, mask)
    ref = torch.tensor([-1.0, -2.0, -3.0, -0.5], dtype=torch.float64)
    loss, _ = dpo_sigmoid_loss_of(seq[:2], seq[2:], ref[:2], ref[2:])
    loss.mean().backward()
    assert torch.isfinite(loss).all()
    assert (token_lp.grad[mask == 0] == 0).all()
    per_row = token_lp.grad.sum(-1) / mask.sum(-1)  # each completion token of a row gets that row's dL/dlogp_seq
    torch.testing.assert_close(token_lp.grad, per_row.unsqueeze(-1) * mask, atol=TOL, rtol=0)


def dpo_sigmoid_loss_of(pc, pr, rc, rr):
    return compute_preference_loss("sigmoid", pc, pr, rc, rr, beta=0.1)


@pytest.mark.parametrize(
    ("name", "kwargs", "field"),
    [
        ("sigmoid", {"beta": 0.0}, "beta"),
        ("sigmoid", {"beta": 0.1, "label_smoothing": 0.5}, "label_smoothing"),
        ("ipo", {"beta": 0.1}, "chosen_tokens"),
        ("ipo", {"beta": 0.1, "label_smoothing": 0.1}, "label_smoothing"),
        ("ipo", {"beta": 0.1, "chosen_tokens": torch.ones(3), "rejected_tokens": torch.ones(2)}, "chosen_tokens"),
    ],
)
def test_preference_loss_refusals_name_the_field(name: str, kwargs: dict, field: str) -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=f"^{field}: "):
        compute_preference_loss(name, x, x, x, x, **kwargs)


def test_unknown_preference_loss_lists_the_known() -> None:
    x = torch.zeros(2)
    with pytest.raises(KeyError, match="unknown preference loss 'dpop'; known: ipo, sigmoid"):
        compute_preference_loss("dpop", x, x, x, x, beta=0.1)


# ---------------------------------------------------------------------------------------------------- KTO


def test_kto_values_gradients_and_reference_point() -> None:
    logps, ref = leaf(6, seed=30, scale=2.0), leaf(6, seed=31, scale=2.0)
    desirable = torch.tensor([True, False, True, True, False, False])
    kl_logps, ref_kl = leaf(6, seed=32), leaf(6, seed=33)
    z0 = kto_reference_point(kl_logps, ref_kl)
    expected_z0 = max(0.0, sum(a - b for a, b in zip(kl_logps.tolist(), ref_kl.tolist())) / 6)
    close(z0, expected_z0)
    assert not z0.requires_grad  # the reference point carries no gradient (TRL detaches it)
    beta, wd, wu = 0.3, 1.0, 1.33
    loss, metrics = kto_loss(logps, ref, desirable, beta=beta, kl=z0, desirable_weight=wd, undesirable_weight=wu)
    loss.mean().backward()
    rows = list(zip(logps.tolist(), ref.tolist(), desirable.tolist()))
    rho = [a - r for a, r, _ in rows]
    # desirable: λ_D (1 − σ(β(ρ − z0))); undesirable: λ_U (1 − σ(β(z0 − ρ)))
    close(loss, [wd * (1 - sig(beta * (p - expected_z0))) if d else wu * (1 - sig(beta * (expected_z0 - p)))
                 for p, (_, _, d) in zip(rho, rows)])  # fmt: skip
    # d/dρ: desirable −λ_D β σ(x)(1 − σ(x)), x = β(ρ − z0); undesirable +λ_U β σ(x)(1 − σ(x)), x = β(z0 − ρ)
    grads = []
    for p, (_, _, d) in zip(rho, rows):
        x = beta * (p - expected_z0) if d else beta * (expected_z0 - p)
        grads.append((-wd if d else wu) * beta * sig(x) * (1 - sig(x)) / 6)
    close(logps.grad, grads)
    close(ref.grad, [-g for g in grads])
    assert kl_logps.grad is None
    chosen = [beta * p for p, (_, _, d) in zip(rho, rows) if d]
    rejected = [beta * p for p, (_, _, d) in zip(rho, rows) if not d]
    close(metrics["kl"], expected_z0)
    close(metrics["rewards/chosen"], sum(chosen) / 3)
    close(metrics["rewards/rejected"], sum(rejected) / 3)
    close(metrics["rewards/margins"], sum(chosen) / 3 - sum(rejected) / 3)
    close(metrics["logps/chosen"], sum(a for a, _, d in rows if d) / 3)


def test_kto_reference_point_is_clamped_at_zero_and_one_sided_batches_log_one_side() -> None:
    close(kto_reference_point(torch.tensor([-3.0, -4.0]), torch.tensor([-1.0, -1.0])), 0.0)
    _, metrics = kto_loss(torch.zeros(2), torch.zeros(2), torch.tensor([True, True]), beta=0.1, kl=0.0)
    assert set(metrics) == {"kl", "rewards/chosen", "logps/chosen"}


def test_kto_mismatched_completions_shift_by_one() -> None:
    assert mismatched_completions([[1], [2, 2], [3]]) == [[3], [1], [2, 2]]
    with pytest.raises(ValueError, match=r"completions: .* need >= 2"):
        mismatched_completions([[1]])


def test_kto_refuses_bad_labels_and_weights() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="desirable: expected a bool tensor"):
        kto_loss(x, x, torch.tensor([1, 0]), beta=0.1, kl=0.0)
    with pytest.raises(ValueError, match="undesirable_weight: must be > 0"):
        kto_loss(x, x, torch.tensor([True, False]), beta=0.1, kl=0.0, undesirable_weight=0.0)


# ---------------------------------------------------------------------------------------------------- SFT


def test_sft_loss_is_the_mean_over_trained_tokens_of_the_batch() -> None:
    lp = leaf(3, 5, seed=40)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float64)
    loss = sft_loss(lp, mask)
    loss.backward()
    kept = [lp[i, t].item() for i in range(3) for t in range(5) if mask[i, t]]
    close(loss, -sum(kept) / len(kept))  # not the mean of per-example means: a token weighs the same in any row
    close(lp.grad, (-mask / len(kept)).tolist())
    close(sft_loss(lp, mask, num_tokens=14.0), -sum(kept) / 14)  # a global count from ranks or accumulation


def test_pad_and_pack_masks() -> None:
    examples = [([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1]), ([3, 4, 5, 6], [0, 0, 1, 1])]
    padded = pad_examples(examples, pad_id=0)
    assert padded.input_ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [3, 4, 5, 6]]
    assert padded.target_mask.tolist() == [[1, 1, 0], [1, 0, 0], [0, 1, 1]]
    packed = pack_examples(examples)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 4, 5, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # target t scores token t + 1: 6 7 | (8: first of example 1, masked) 9 | (3 masked) 4 5 6
    assert packed.target_mask.tolist() == [[1, 1, 0, 1, 0, 0, 1, 1]]
    assert packed.example_ids.tolist() == [[0, 0, -1, 1, -1, 2, 2, 2]]
    assert packed.attention_mask is None
    with pytest.raises(ValueError, match=r"examples\[1\]: loss mask of 1 for 2 token ids"):
        pack_examples([([1], [1]), ([1, 2], [1])])


# eager attention takes its softmax in float32 (Qwen2's eager_attention_forward), so a float64 model agrees with
# itself across layouts to float32 rounding there
@pytest.mark.parametrize(("attention", "tol"), [("sdpa", 1e-10), ("eager", 1e-6)])
def test_packed_sft_loss_equals_the_padded_and_per_example_losses(attention: str, tol: float) -> None:
    """A tiny Qwen2 in float64: one packed row (positions restart per example, no attention mask, no cache) and the
    right-padded batch give the same loss and the same gradients, and each example's token sum in the pack equals
    that example's forward alone."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=32, layers=2, max_positions=64).double()
    model.set_attn_implementation(attention)
    g = torch.Generator().manual_seed(7)
    examples = []
    for length, prompt in ((9, 4), (5, 2), (12, 7), (3, 1)):
        ids = torch.randint(3, len(tokenizer), (length,), generator=g).tolist()
        examples.append((ids, [0] * prompt + [1] * (length - prompt)))

    def loss_and_grads(batch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
        lp = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
        loss = sft_loss(lp, batch.target_mask)
        loss.backward()
        return loss.detach(), lp.detach(), [p.grad.clone() for p in model.parameters()]

    padded = pad_examples(examples, pad_id=tokenizer.pad_token_id)
    packed = pack_examples(examples)
    pad_loss, pad_lp, pad_grads = loss_and_grads(padded)
    pack_loss, pack_lp, pack_grads = loss_and_grads(packed)
    torch.testing.assert_close(pack_loss, pad_loss, atol=tol, rtol=0)
    for a, b in zip(pack_grads, pad_grads):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    for index, (ids, mask) in enumerate(examples):
        alone = pad_examples([(ids, mask)], pad_id=tokenizer.pad_token_id)
        _, alone_lp, _ = loss_and_grads(alone)
        alone_sum = sequence_logprobs(alone_lp, alone.target_mask)
        in_pack = (packed.example_ids == index).double() * packed.target_mask
        torch.testing.assert_close(sequence_logprobs(pack_lp, in_pack), alone_sum, atol=tol, rtol=0)
        in_pad = (padded.example_ids == index).double() * padded.target_mask
        torch.testing.assert_close(sequence_logprobs(pad_lp, in_pad)[index : index + 1], alone_sum, atol=tol, rtol=0)


def test_token_accuracy_counts_trained_tokens_only() -> None:
    logits = torch.tensor([[[0.0, 2.0], [3.0, 0.0], [0.0, 1.0]]])
    targets = torch.tensor([[1, 1, 0]])
    close(token_accuracy(logits, targets, torch.tensor([[1, 1, 0]])), 0.5)
    close(token_accuracy(logits, targets, torch.tensor([[1, 0, 0]])), 1.0)


# ------------------------------------------------------------------------------------------- distillation


def test_distill_advantage_is_the_negated_reverse_kl_on_sampled_tokens() -> None:
    student, teacher = leaf(3, 4, seed=50), leaf(3, 4, seed=51)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    adv = distill_advantage(student, teacher, mask, coef=0.5)
    expected = [
        [-0.5 * (s - t) if m else 0.0 for s, t, m in zip(sr, tr, mr)]
        for sr, tr, mr in zip(student.tolist(), teacher.tolist(), mask.tolist())
    ]
    close(adv, expected)
    assert not adv.requires_grad
    nan_student = torch.where(mask == 1, student.detach(), torch.full_like(student, float("nan")))
    assert torch.isfinite(distill_advantage(nan_student, teacher, mask)).all()
    with pytest.raises(ValueError, match="teacher_logprob: expected shape"):
        distill_advantage(student, teacher[:, :2], mask)


def test_a_task_advantage_adds_to_each_token_of_its_sample_on_the_mask() -> None:
    student, teacher = leaf(3, 4, seed=54), leaf(3, 4, seed=55)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    task = torch.tensor([0.7, -1.2, 0.25], dtype=torch.float64)
    adv = with_task_advantage(task, distill_advantage(student, teacher, mask, coef=2.0), mask)
    expected = [
        [a - 2.0 * (s - t) if m else 0.0 for s, t, m in zip(sr, tr, mr)]
        for a, sr, tr, mr in zip(task.tolist(), student.tolist(), teacher.tolist(), mask.tolist())
    ]
    close(adv, expected)
    assert not adv.requires_grad
    with pytest.raises(ValueError, match=r"task_advantage: expected shape \(3,\)"):
        with_task_advantage(task[:2], adv, mask)


def test_mean_reverse_kl_is_the_token_mean_of_the_negated_advantage_over_the_mask() -> None:
    student, teacher = leaf(3, 4, seed=52), leaf(3, 4, seed=53)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [0, 1, 1, 0]])
    expected = -float(distill_advantage(student, teacher, mask).sum()) / 7
    assert abs(mean_reverse_kl(student, teacher, mask) - expected) < 1e-6
    assert mean_reverse_kl(student, teacher, torch.zeros_like(mask)) == 0.0
