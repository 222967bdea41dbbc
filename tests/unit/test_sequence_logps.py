"""Sequence log-probs of packed completions (relayrl/trainer/sequence_logps.py), the scores DPO and KTO train on:
each sequence's sum in one padding-free forward equals its completion's log-prob in a forward of its own, and
with LoRA the reference is the policy with its adapter disabled: the base model's numbers, whatever the adapter
holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offline_testing import tiny_chat_model
from trainer_testing import one_rank_world  # noqa: F401  (a module fixture: the backend's one-rank world)
from transformers import AutoModelForCausalLM

from relayrl.config import LoraConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.sequence_logps import completion_sequence, packed_sequence_logps

SEQUENCES = [
    completion_sequence([5, 9, 12], [7, 3]),
    completion_sequence([5, 9, 12], [8, 8, 2, 4]),
    completion_sequence([6, 2], [11]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("logps") / "model")


def alone(model: torch.nn.Module, ids: list[int], mask: list[int]) -> float:
    """log π(completion | prompt) of one sequence in a forward of its own, float64 sums."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    logprob = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return float((logprob * torch.tensor(mask[1:], dtype=torch.float64)).sum())


def test_packed_sums_equal_each_completion_alone(model_dir) -> None:
    backend = FSDPBackend(ModelConfig(path=str(model_dir)), TrainerConfig(precision="float32"), with_reference=False)
    logps, tokens = packed_sequence_logps(backend, SEQUENCES)
    assert tokens.tolist() == [2.0, 4.0, 1.0]
    expected = [alone(backend.model, ids, mask) for ids, mask in SEQUENCES]
    torch.testing.assert_close(logps.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
    assert logps.requires_grad  # the policy's scores train


def test_with_lora_the_reference_is_the_base_with_the_adapter_disabled(model_dir) -> None:
    model_cfg = ModelConfig(path=str(model_dir), lora=LoraConfig(rank=4))
    backend = FSDPBackend(model_cfg, TrainerConfig(precision="float32"), with_reference=False)  # no second copy
    with torch.no_grad():  # an adapter that has trained: B no longer zero
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference, _ = packed_sequence_logps(backend, SEQUENCES, reference=True)
    expected = [alone(base, ids, mask) for ids, mask in SEQUENCES]
    torch.testing.assert_close(reference.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not reference.requires_grad
    policy, _ = packed_sequence_logps(backend, SEQUENCES)
    assert (policy.detach() - reference).abs().max() > 1e-3  # the adapter changes the policy, not the reference
