"""The learning-rate schedule: the lr of trainer step s (1-based) is a pure function of s and the config, so a
resumed run continues it exactly from its checkpoint's step (verl steps its scheduler once per trainer step too;
every mini-batch of a step uses the step's lr).

With W warmup steps (``trainer.warmup_steps``, else ``ceil(warmup_ratio x steps)``), T = ``trainer.steps``,
peak lr = ``trainer.lr`` and floor m = ``min_lr_ratio``:

- warmup, s <= W: lr x s / W (step W reaches the peak; unlike transformers' schedules, step 1 does not get lr 0);
- after it, with progress p = (s - 1 - W) / (T - W) in [0, 1): ``constant`` lr; ``linear``
  lr x (m + (1 - m)(1 - p)); ``cosine`` lr x (m + (1 - m)(1 + cos(pi p)) / 2). The first step after warmup
  trains at the peak, as transformers' ``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``
  (with ``min_lr_rate``) do at the same optimizer step.

The critic (``algorithm.advantage: gae``) follows the same schedule from its own peak: ``critic.lr`` x
lr_at(s) / ``trainer.lr`` (its warmup and decay are the policy's).
"""

from __future__ import annotations

import math

from relayrl.config import RelayConfig, TrainerConfig


def warmup_steps(cfg: TrainerConfig) -> int:
    """``warmup_steps`` when set, else ``ceil(warmup_ratio x steps)``."""
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * cfg.steps)


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """The learning rate of trainer step ``step`` (1-based; module docstring)."""
    warmup = warmup_steps(cfg)
    if step <= warmup:
        return cfg.lr * step / warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - 1 - warmup) / max(1, cfg.steps - warmup))
    decay = 1.0 - progress if cfg.lr_schedule == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay)


def set_lr(optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` steps at ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def set_step_lrs(backend, step: int, cfg: RelayConfig) -> float:
    """Step ``step``'s lr on the policy's optimizer and, with a critic, the critic's (module docstring); returns the
    policy's."""
    lr = lr_at(step, cfg.trainer)
    set_lr(backend.optimizer, lr)
    if backend.critic is not None:
        set_lr(backend.critic.optimizer, cfg.critic.lr * lr / cfg.trainer.lr)
    return lr
