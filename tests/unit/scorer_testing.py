"""Tiny scorer models for the scorer tests: a reward model exported in relayrl's format (relayrl/rewards/
reward_model.py) from the tiny ChatML Qwen2, with a seeded score head far from zero (as after training); a judge from
the same Qwen2 that answers with a number."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def write_tiny_judge(path: Path, *, seed: int = 0, digit: str = "7") -> Path:
    """The untrained tiny ChatML Qwen2 at ``path``, its (tied) output row of ``digit`` set to twice the row of the
    token it predicts after a chat prompt: its greedy answers are then that digit (an untrained one's are newlines,
    no number for a judge to read)."""
    write_tiny_chat_model(path, seed=seed, pretrain=False)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "rate"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        predicted = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        rows = model.get_output_embeddings().weight
        rows[tokenizer.convert_tokens_to_ids(digit)] = 2 * rows[predicted]
    model.save_pretrained(path)
    return path
