"""The trainer's AdamW runs torch's fused kernel and steps as the reference single-tensor loop does; its state created
before the first step leaves every step as it was."""

from __future__ import annotations

import torch

from relayrl.config import TrainerConfig
from relayrl.trainer.optim import adamw, create_state


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
    create_state(optimizer)  # its gradient is still there, and so is its state
    params[0].grad = None
    create_state(optimizer)
    assert all(torch.equal(optimizer.state[params[0]][key], value) for key, value in before.items())
