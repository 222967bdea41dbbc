"""The Megatron backend in one process (a 1-rank gloo world, TP = PP = 1) on an untied Llama: the same
log-probs, entropy and step as the FSDP backend; checkpoints restore model and optimizer exactly; the HF
export is the gathered weights. (TP=2, PP=2 and DP=2 against FSDP: tests/integration/test_megatron_parity.py.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.models.tiny import build_tokenizer
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends import create_backend
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.step import train_on_batch

TRAINER = {"lr": 1e-3, "mini_batches": 2, "precision": "float32"}  # the backends agree to float rounding


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama with untied embeddings and no attention bias (the other layout Qwen2's tests miss)."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def batch(vocab: int, groups: int = 4, n: int = 4, length: int = 10) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    rows = groups * n
    response_mask = torch.zeros(rows, length - 1)
    response_mask[:, 3:] = 1.0
    return TrainBatch(
        input_ids=torch.randint(3, vocab, (rows, length), generator=g),
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        response_mask=response_mask,
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rollout_logprobs=-torch.rand(rows, length - 1, generator=g) * response_mask,
        teacher_logprobs=torch.zeros(rows, length - 1),
        rewards=torch.rand(rows, generator=g),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
        exact_rollout=torch.zeros(rows, dtype=torch.bool),  # random rollout logprobs: the step recomputes
    )


def gathered(backend) -> dict[str, torch.Tensor]:
    into = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in backend.weight_specs()}
    backend.gather_weights(into)
    return into


def test_same_logprobs_step_checkpoint_and_export_as_fsdp(llama_dir, tmp_path):
    fsdp = create_backend(ModelConfig(path=str(llama_dir)), TrainerConfig(**TRAINER), with_reference=False)
    mega = create_backend(
        ModelConfig(path=str(llama_dir)), TrainerConfig(**TRAINER, backend="megatron"), with_reference=False
    )
    assert (mega.dp_rank, mega.dp_size) == (fsdp.dp_rank, fsdp.dp_size) == (0, 1)
    assert mega.weight_specs() == fsdp.weight_specs()  # the same manifest: lm_head.weight included (untied)
    data = batch(len(build_tokenizer()))
    with torch.no_grad():
        for got, want in zip(mega.logprobs(data.input_ids, data.attention_mask, 0.7),
                             fsdp.logprobs(data.input_ids, data.attention_mask, 0.7)):  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    metrics = {}
    for name, backend in (("fsdp", fsdp), ("megatron", mega)):
        metrics[name] = train_on_batch(backend, data, AlgorithmConfig(), TrainerConfig(**TRAINER), temperature=1.0,
                                       norm_len=8)  # fmt: skip
    assert abs(metrics["megatron"]["loss"] - metrics["fsdp"]["loss"]) <= 1e-5
    after, reference = gathered(mega), gathered(fsdp)
    assert max(float((after[k] - reference[k]).abs().max()) for k in reference) <= 1e-5

    mega.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    train_on_batch(mega, data, AlgorithmConfig(), TrainerConfig(**TRAINER), temperature=1.0, norm_len=8)
    assert any(not torch.equal(after[k], v) for k, v in gathered(mega).items())  # it moved on
    assert mega.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    assert all(torch.equal(after[k], v) for k, v in gathered(mega).items())
    assert all(state["step"] == 2 for state in mega.optimizer.state.values())  # Adam's state came back too

    mega.export_hf(tmp_path / "final", build_tokenizer())
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final").named_parameters())
    assert all(torch.equal(exported[k], v) for k, v in after.items())
