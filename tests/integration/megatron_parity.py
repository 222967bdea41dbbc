"""Run under torchrun with 2 ranks: one training step (two mini-batches, every loss term) on the same batch
and weights with the FSDP backend, then the Megatron backend at TP=2, at PP=2 and at DP=2; with 8 ranks: FSDP,
then Megatron at TP=2 x PP=2 x DP=2 (the gpu-megatron overlay's layout). Rank 0 writes
JSON (argv[2]): losses, gradient norms and metrics, and for Megatron the checksums of the weights the
publisher's arena receives and of the Megatron HF export, and their largest difference to FSDP's HF
export. argv[1]: the tiny model dir."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.config import AlgorithmConfig, MegatronConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends import create_backend
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.step import train_on_batch
from relayrl.weightsync.checksum import weights_checksum

# Every term of the loss: PPO clip, KL to the reference model, the entropy bonus (its vocab-parallel gradient).
ALGORITHM = AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01)
COMPARED = ("loss", "grad_norm", "entropy", "ref_kl", "ppo_kl", "clip_frac")
LAYOUTS = {  # world size -> label -> layout (DP: the ranks left over)
    2: {"tp2": MegatronConfig(tensor_parallel=2), "pp2": MegatronConfig(pipeline_parallel=2), "dp2": MegatronConfig()},
    8: {"tp2_pp2_dp2": MegatronConfig(tensor_parallel=2, pipeline_parallel=2)},
}


def make_batch(vocab: int, groups: int = 4, n: int = 4, length: int = 9) -> TrainBatch:
    """Right-padded rows: a 3-token prompt, a response of 2..length-3 tokens, random rewards per group."""
    g = torch.Generator().manual_seed(0)
    rows = groups * n
    input_ids = torch.randint(3, vocab, (rows, length), generator=g)
    lengths = torch.randint(5, length + 1, (rows,), generator=g)
    attention_mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    input_ids = input_ids * attention_mask
    response_mask = torch.zeros(rows, length - 1)
    for i, total in enumerate(lengths.tolist()):
        response_mask[i, 2 : total - 1] = 1.0
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rollout_logprobs=-torch.rand(rows, length - 1, generator=g) * response_mask,
        teacher_logprobs=torch.zeros(rows, length - 1),
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
        exact_rollout=torch.zeros(rows, dtype=torch.bool),  # random rollout logprobs: the step recomputes
    )


def one_step(model_dir: str, trainer: TrainerConfig, batch: TrainBatch, export: Path) -> tuple[dict, dict | None]:
    """(metrics, on rank 0 the full updated HF weights as the publisher's arena receives them, else None);
    the backend's Hugging Face export goes to ``export``."""
    backend = create_backend(ModelConfig(path=model_dir), trainer, with_reference=ALGORITHM.kl_coef > 0)
    metrics = train_on_batch(backend, batch, ALGORITHM, trainer, temperature=0.7, norm_len=8)
    specs = backend.weight_specs()
    into = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in specs} if dist.get_rank() == 0 else None
    backend.gather_weights(into)
    backend.export_hf(export, AutoTokenizer.from_pretrained(model_dir))
    return metrics, into


def exported(directory: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())


def main(model_dir: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    from megatron.core import parallel_state as ps

    from relayrl.models.tiny import build_tokenizer

    batch = make_batch(len(build_tokenizer()))
    base = {"lr": 1e-3, "mini_batches": 2, "nproc": dist.get_world_size(), "precision": "float32"}  # to rounding
    work = Path(out).parent
    metrics, _ = one_step(model_dir, TrainerConfig(**base), batch, work / "fsdp")
    results = {"fsdp": {key: metrics[key] for key in COMPARED}}
    reference = exported(work / "fsdp") if dist.get_rank() == 0 else None
    for label, layout in LAYOUTS[dist.get_world_size()].items():
        trainer = TrainerConfig(**base, backend="megatron", megatron=layout)
        metrics, received = one_step(model_dir, trainer, batch, work / label)
        ps.destroy_model_parallel()
        results[label] = {key: metrics[key] for key in COMPARED}
        if received is not None:
            own = exported(work / label)
            results[label] |= {
                "names": list(received) == list(reference),  # the same manifest order as FSDP
                "received_checksum": weights_checksum(received.items()),
                "export_checksum": weights_checksum(own.items()),
                "max_abs_diff": max(float((received[k] - reference[k]).abs().max()) for k in reference),
            }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
