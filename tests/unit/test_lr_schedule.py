"""The lr schedule (relayrl/trainer/schedule.py): warmup from step 1, then transformers' linear / cosine schedules
at the same optimizer step, a floor, and a pure function of the step (what makes a resume continue it exactly)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from relayrl.config import ConfigError, TrainerConfig, parse_config
from relayrl.trainer.schedule import lr_at, set_lr, set_step_lrs, warmup_steps

STEPS, WARMUP, LR = 20, 4, 1e-3


def transformers_lrs(schedule) -> list[float]:
    """The lr transformers' scheduler gives each of STEPS optimizer steps (index 0 = the first step)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = schedule(optimizer, WARMUP, STEPS)
    lrs = []
    for _ in range(STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    ("kind", "schedule"), [("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)]
)
def test_decay_after_warmup_is_transformers_schedule(kind, schedule) -> None:
    cfg = TrainerConfig(lr=LR, steps=STEPS, warmup_steps=WARMUP, lr_schedule=kind)
    reference = transformers_lrs(schedule)
    for step in range(WARMUP + 1, STEPS + 1):
        assert lr_at(step, cfg) == pytest.approx(reference[step - 1], rel=1e-12), step
    # warmup rises to the peak at step W, and step 1 already trains (transformers' step 1 has lr 0)
    assert [lr_at(s, cfg) for s in range(1, WARMUP + 1)] == pytest.approx([LR * s / WARMUP for s in (1, 2, 3, 4)])
    assert reference[0] == 0.0 < lr_at(1, cfg)


def test_constant_floor_and_ratio() -> None:
    assert {lr_at(s, TrainerConfig(lr=LR, steps=STEPS)) for s in range(1, STEPS + 1)} == {LR}
    cosine = TrainerConfig(lr=LR, steps=STEPS, lr_schedule="cosine", min_lr_ratio=0.1, warmup_ratio=0.25)
    assert warmup_steps(cosine) == 5
    lrs = [lr_at(s, cosine) for s in range(1, STEPS + 1)]
    assert lrs[4] == LR and all(a >= b for a, b in itertools.pairwise(lrs[4:]))  # peak at the warmup's end, then down
    progress = (STEPS - 1 - 5) / (STEPS - 5)
    assert lrs[-1] == pytest.approx(LR * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2))
    assert min(lrs) >= 0.1 * LR


def test_set_lr_sets_every_group() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    set_lr(optimizer, 0.25)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"steps": 5, "warmup_steps": 6}, "trainer.warmup_steps (6) exceeds trainer.steps (5)"),
        ({"warmup_steps": 2, "warmup_ratio": 0.1}, "set one of them"),
        ({"lr_schedule": "step"}, "trainer.lr_schedule"),
    ],
)
def test_bad_schedules_are_refused_naming_the_key(trainer, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "trainer": trainer})


def test_the_critic_follows_the_schedule_from_its_own_peak() -> None:
    """critic.lr x lr_at / trainer.lr each step (it stayed at critic.lr through the policy's warmup and decay)."""
    from types import SimpleNamespace

    cfg = parse_config({
        "model": {"path": "m"}, "data": {"path": "d.jsonl"}, "algorithm": {"advantage": "gae"},
        "critic": {"lr": 1e-5},
        "trainer": {"lr": LR, "steps": STEPS, "warmup_steps": WARMUP, "lr_schedule": "cosine"},
    })  # fmt: skip

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    backend = SimpleNamespace(optimizer=adamw(), critic=SimpleNamespace(optimizer=adamw()))
    for step in (1, WARMUP, WARMUP + 1, STEPS // 2, STEPS):
        assert set_step_lrs(backend, step, cfg) == lr_at(step, cfg.trainer)
        assert backend.optimizer.param_groups[0]["lr"] == lr_at(step, cfg.trainer)
        assert backend.critic.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5 * lr_at(step, cfg.trainer) / LR)
    assert set_step_lrs(SimpleNamespace(optimizer=adamw(), critic=None), 1, cfg) == LR / WARMUP
