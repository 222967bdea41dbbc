"""The reward-model format: a Hugging Face ``AutoModelForSequenceClassification`` directory with one label, as TRL's
``RewardTrainer`` writes it, so ``transformers`` loads it unchanged (OpenRLHF's reward models also name their head
``score``, but OpenRLHF reads them with its own class; that round trip is not checked here).

The directory holds ``config.json`` (the family's ``*ForSequenceClassification`` architecture, ``num_labels: 1``,
``pad_token_id`` set), ``model.safetensors`` (the backbone and ``score.weight`` [1, hidden]) and the tokenizer.
The score of a sequence is the head's output at its last token: transformers' sequence classifiers take the
rightmost position whose token is not ``pad_token_id`` (left or right padding alike), which is why the pad id must
be in the config; with no pad id a batch of more than one row is refused. Where the pad token is also the EOS token,
a trailing EOS counts as padding and the score is read at the token before it (TRL's models do the same).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def pad_token_of(tokenizer: Any) -> str:
    """The tokenizer's pad token, else its EOS token (TRL's choice); ValueError when it has neither."""
    pad = tokenizer.pad_token or tokenizer.eos_token
    if pad is None:
        raise ValueError("tokenizer: no pad token and no EOS token; a reward model needs one to find each row's end")
    return pad


def reward_model_from_causal_lm(
    path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """(model, tokenizer): the causal LM at ``path`` as a one-label sequence classifier, its backbone's weights
    loaded and a fresh score head initialised by the family's own ``_init_weights`` under ``seed`` (the LM head is
    dropped), as TRL's ``RewardTrainer`` builds one from a model id. The tokenizer's pad token is set (its own, else
    EOS) and the config's ``pad_token_id`` with it. The global RNG is left as it was."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.pad_token = pad_token_of(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=dtype
        )
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def check_reward_model(model: Any) -> None:
    """ValueError naming the config key unless ``model`` is a one-label classifier that knows its pad token."""
    if getattr(model.config, "num_labels", None) != 1:
        raise ValueError(
            f"num_labels: a reward model has one label (one score a sequence), got {model.config.num_labels}"
        )
    if model.config.get_text_config().pad_token_id is None:
        raise ValueError(
            "pad_token_id: not set in the config; the classifier could not find each padded row's last token"
        )


def save_reward_model(model: Any, tokenizer: Any, directory: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` as a reward-model directory (module docstring): safetensors weights, the
    config with ``num_labels`` 1 and the tokenizer's ``pad_token_id``; returns the directory."""
    check_reward_model(model)
    pad_id = model.config.get_text_config().pad_token_id
    if tokenizer.pad_token_id != pad_id:
        raise ValueError(f"pad_token_id: the config says {pad_id}, the tokenizer pads with {tokenizer.pad_token_id}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def load_reward_model(directory: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of a reward-model directory (relayrl's or TRL's), checked as
    ``check_reward_model`` says, in eval mode."""
    model = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=dtype)
    check_reward_model(model)
    return model.eval(), AutoTokenizer.from_pretrained(str(directory))


def reward_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar per row [B]: the classifier's output at each row's last non-pad token."""
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.squeeze(-1)
