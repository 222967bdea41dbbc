"""The reward-model format (relayrl/rewards/reward_model.py): a tiny Qwen2 causal LM becomes a one-label sequence
classifier (its backbone kept, a fresh seeded score head), the export loads with
``AutoModelForSequenceClassification.from_pretrained`` and nothing else, and scores what the in-memory model scores
on right- and left-padded batches."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from relayrl.models.tiny_chat import write_tiny_chat_model
from relayrl.rewards.reward_model import (
    load_reward_model,
    reward_model_from_causal_lm,
    reward_scores,
    save_reward_model,
)


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("lm") / "tiny-chat", seed=0, pretrain=False)


def padded(tokenizer, texts: list[str], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer.padding_side = side
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


TEXTS = ["<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n", "a", "guess my number 4 higher"]


def test_a_causal_lm_becomes_a_one_label_classifier_with_its_backbone(causal_dir) -> None:
    model, tokenizer = reward_model_from_causal_lm(causal_dir, seed=3)
    causal = AutoModelForCausalLM.from_pretrained(causal_dir)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token != tokenizer.eos_token
    backbone = dict(causal.model.named_parameters())
    for name, param in model.model.named_parameters():
        torch.testing.assert_close(param, backbone[name], atol=0, rtol=0)
    assert model.score.weight.shape == (1, causal.config.hidden_size)
    again, _ = reward_model_from_causal_lm(causal_dir, seed=3)
    other, _ = reward_model_from_causal_lm(causal_dir, seed=4)
    assert torch.equal(again.score.weight, model.score.weight)  # the seed decides the head
    assert not torch.equal(other.score.weight, model.score.weight)


def test_the_export_loads_unchanged_and_scores_as_the_model_in_memory(causal_dir, tmp_path) -> None:
    model, tokenizer = reward_model_from_causal_lm(causal_dir, seed=0)
    with torch.no_grad():
        model.score.weight.normal_(0, 1)  # scores well away from 0, as after training
    out = save_reward_model(model, tokenizer, tmp_path / "rm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["pad_token_id"] == tokenizer.pad_token_id and len(config["id2label"]) == 1
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()  # transformers alone, no kwargs
    model.eval()
    alone = []
    with torch.no_grad():
        for text in TEXTS:
            ids, mask = padded(tokenizer, [text], "right")
            alone.append(reward_scores(model, ids, mask).item())
        for side in ("right", "left"):
            ids, mask = padded(tokenizer, TEXTS, side)
            assert (ids == tokenizer.pad_token_id).any()  # the batch is padded
            expected = reward_scores(model, ids, mask)
            torch.testing.assert_close(reward_scores(loaded, ids, mask), expected, atol=1e-6, rtol=0)
            if side == "right":  # the score is read at each row's last real token, not at its padding
                torch.testing.assert_close(expected, torch.tensor(alone), atol=1e-5, rtol=0)
    relayrl_loaded, loaded_tokenizer = load_reward_model(out)
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    with torch.no_grad():
        ids, mask = padded(loaded_tokenizer, TEXTS, "left")
        torch.testing.assert_close(reward_scores(relayrl_loaded, ids, mask), reward_scores(model, ids, mask))


def test_an_export_that_could_not_score_is_refused_naming_the_key(causal_dir, tmp_path) -> None:
    model, tokenizer = reward_model_from_causal_lm(causal_dir)
    two = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=2)
    with pytest.raises(ValueError, match=r"^num_labels: a reward model has one label"):
        save_reward_model(two, tokenizer, tmp_path / "two")
    model.config.pad_token_id = None
    with pytest.raises(ValueError, match=r"^pad_token_id: not set in the config"):
        save_reward_model(model, tokenizer, tmp_path / "nopad")
    assert not (tmp_path / "nopad").exists()
