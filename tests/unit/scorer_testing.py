"""Tiny scorer models for the scorer tests: a reward model exported in relayrl's format (relayrl/rewards/
reward_model.py) from the tiny ChatML Qwen2, with a seeded score head far from zero (as after training)."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.models.tiny_chat import write_tiny_chat_model
from relayrl.rewards.reward_model import reward_model_from_causal_lm, save_reward_model


def write_tiny_reward_model(path: Path, *, seed: int = 0) -> Path:
    """A one-label Qwen2 sequence classifier with the tiny chat tokenizer (its ChatML template) at ``path``."""
    causal = write_tiny_chat_model(path.with_name(f"{path.name}-lm"), seed=seed, pretrain=False)
    model, tokenizer = reward_model_from_causal_lm(causal, seed=seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.score.weight.normal_(0, 1)
    return save_reward_model(model, tokenizer, path)
