"""The trainer's AdamW runs torch's fused kernel and steps as the reference single-tensor loop does."""

from __future__ import annotations

import torch

from relayrl.config import TrainerConfig
from relayrl.trainer.optim import adamw


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
