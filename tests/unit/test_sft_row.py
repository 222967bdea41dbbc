"""One packed row of ``relayrl train sft`` through the trainer's own code (relayrl/trainer/sft.py
``SFTStage.row_forward``): its loss, its metric sums and its gradients equal those of transformers' causal-LM loss
(labels -100 off the trained tokens) over the same examples as a right-padded batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offline_testing import tiny_chat_model
from trainer_testing import one_rank_world  # noqa: F401  (a module fixture: the backend's one-rank world)

from relayrl.algorithms.sft_loss import pad_examples
from relayrl.config import ModelConfig, TrainerConfig
from relayrl.data.trl_formats import SFTExample
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.sft import SFTStage

EXAMPLES = [
    SFTExample([5, 9, 12, 7, 3, 8], [0, 0, 1, 1, 1, 1]),
    SFTExample([6, 2, 11], [1, 1, 1]),
    SFTExample([4, 4, 10, 13, 9, 2, 5, 7], [0, 0, 0, 1, 0, 1, 1, 1]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("sft-row") / "model")


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_packed_rows_loss_sums_and_gradients_equal_the_padded_batchs(model_dir) -> None:
    backend = FSDPBackend(ModelConfig(path=str(model_dir)), TrainerConfig(precision="float32"), with_reference=False)
    model, stage = backend.model, SFTStage()
    trained = stage.normaliser(EXAMPLES, range(len(EXAMPLES)))
    assert trained == 4 + 2 + 4

    padded = pad_examples([(e.input_ids, e.loss_mask) for e in EXAMPLES], pad_id=0)
    labels = torch.full_like(padded.input_ids, -100)  # token t is a label where its mask says so (t >= 1)
    for row, example in enumerate(EXAMPLES):
        for t in range(1, len(example.input_ids)):
            if example.loss_mask[t]:
                labels[row, t] = example.input_ids[t]
    model.zero_grad()
    out = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, labels=labels, use_cache=False)
    out.loss.backward()
    expected_loss = out.loss.item()
    expected_grads = grads(model)
    scored = labels[:, 1:] != -100
    correct = (out.logits[:, :-1].argmax(-1) == padded.input_ids[:, 1:])[scored].sum()

    model.zero_grad()
    loss, sums = stage.row_forward(backend, EXAMPLES, [0, 1, 2], trained)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    nll, accurate, tokens = sums.tolist()
    assert tokens == trained and accurate == int(correct)
    assert nll == pytest.approx(expected_loss * trained, abs=1e-5)
    got = grads(model)
    assert got.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)
