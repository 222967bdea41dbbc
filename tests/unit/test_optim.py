"""The trainer's AdamW runs torch's fused kernel and steps as the reference single-tensor loop does; its state created
before the first step leaves every step as it was."""

from __future__ import annotations

import pytest
import torch

from relayrl.config import TrainerConfig
from relayrl.trainer.optim import adamw, create_state, fault_in_gradients


def test_fused_adamw_steps_as_the_single_tensor_loop() -> None:
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95))
    torch.manual_seed(0)
    fused_params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 8), (8,), (3, 5, 7))]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    start = [p.detach().clone() for p in fused_params]
    fused = adamw(fused_params, cfg)
    loop = torch.optim.AdamW(loop_params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False)
    assert fused.param_groups[0]["fused"] and fused.param_groups[0]["lr"] == cfg.lr
    for _ in range(20):
        for a, b in zip(fused_params, loop_params):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b, s in zip(fused_params, loop_params, start):
        assert not torch.equal(a, s)  # it trained
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_created_before_the_first_step_leaves_that_step_exact() -> None:
    """``create_state`` moves nothing, and the step after it is bit for bit the one an optimizer without it takes."""
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    torch.manual_seed(0)
    cold_params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 8), (8,), (3, 5, 7))]
    warm_params = [torch.nn.Parameter(p.detach().clone()) for p in cold_params]
    cold, warm = adamw(cold_params, cfg), adamw(warm_params, cfg)
    create_state(warm)
    assert all(torch.equal(a, b) for a, b in zip(warm_params, cold_params, strict=True))
    assert all(p.grad is None for p in warm_params) and warm.param_groups[0]["lr"] == cfg.lr
    for state in warm.state.values():
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    for _ in range(3):
        for a, b in zip(cold_params, warm_params, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        cold.step()
        warm.step()
    assert all(torch.equal(a, b) for a, b in zip(warm_params, cold_params, strict=True))
    for a, b in zip(cold.state.values(), warm.state.values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_state_is_not_recreated_over_a_resumed_one() -> None:
    cfg = TrainerConfig(lr=1e-2)
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    optimizer = adamw(params, cfg)
    params[0].grad = torch.randn(4, 4)
    optimizer.step()
    before = {key: value.clone() for key, value in optimizer.state[params[0]].items()}
    create_state(optimizer)
    assert all(torch.equal(optimizer.state[params[0]][key], value) for key, value in before.items())


@pytest.mark.parametrize(
    "options",
    [{"fused": True}, {"foreach": True}, {"foreach": False, "amsgrad": True}],  # capturable: a GPU's
    ids=["fused", "foreach", "amsgrad"],
)
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_created_state_is_what_the_first_step_makes_entry_for_entry(kind, options) -> None:
    """Same keys, and each entry of the same dtype, device, shape and strides as the state torch's first step
    creates (``Adam._init_group``); and no gradient is left behind."""
    torch.manual_seed(0)
    stepped_params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((6, 4), (4,))]
    created_params = [torch.nn.Parameter(p.detach().clone()) for p in stepped_params]
    stepped, created = kind(stepped_params, lr=0.0, **options), kind(created_params, lr=0.0, **options)
    for p in stepped_params:
        p.grad = torch.zeros_like(p)
    stepped.step()
    create_state(created)
    assert all(p.grad is None for p in created_params)
    for a, b in zip(stepped.state.values(), created.state.values(), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert (b[key].dtype, b[key].device, b[key].shape, b[key].stride()) == (
                a[key].dtype, a[key].device, a[key].shape, a[key].stride()
            ), key  # fmt: skip
            assert not b[key].any()


def test_an_optimizer_whose_state_it_does_not_know_is_refused() -> None:
    with pytest.raises(TypeError, match="optimizer: create_state knows Adam's state, not SGD's"):
        create_state(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))


def test_faulting_in_the_gradients_leaves_parameters_gradients_and_state_alone() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = adamw(params, TrainerConfig(lr=1e-2))
    before = [p.detach().clone() for p in params]
    params[1].grad = torch.ones(4)
    fault_in_gradients(optimizer)
    assert params[0].grad is None and torch.equal(params[1].grad, torch.ones(4)) and not optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
