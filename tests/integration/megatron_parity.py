"""Run under torchrun with 2 ranks: one training step (two mini-batches) on the same batch and weights with
the FSDP backend, the Megatron backend at TP=2 and at PP=2; rank 0 writes the losses, the updated full
weights' checksums and their largest differences to FSDP as JSON (argv[2]). argv[1]: the tiny model dir."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.config import AlgorithmConfig, MegatronConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends import create_backend
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.step import train_on_batch
from relayrl.weightsync.checksum import weights_checksum

LAYOUTS = {"tp2": MegatronConfig(tensor_parallel=2), "pp2": MegatronConfig(pipeline_parallel=2)}


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
        rollout_logprobs=-torch.rand(rows, length - 1, generator=g) * response_mask,
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
    )


def one_step(model_dir: str, trainer: TrainerConfig, batch: TrainBatch) -> tuple[dict, dict | None]:
    """(metrics, full updated HF weights on rank 0 else None)."""
    backend = create_backend(ModelConfig(path=model_dir), trainer, with_reference=False)
    metrics = train_on_batch(backend, batch, AlgorithmConfig(), trainer, temperature=1.0, norm_len=8)
    specs = backend.weight_specs()
    into = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in specs} if dist.get_rank() == 0 else None
    backend.gather_weights(into)
    return metrics, into


def main(model_dir: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    from megatron.core import parallel_state as ps

    from relayrl.models.tiny import build_tokenizer

    batch = make_batch(len(build_tokenizer()))
    base = {"lr": 1e-3, "mini_batches": 2, "nproc": 2}
    metrics, reference = one_step(model_dir, TrainerConfig(**base), batch)
    results = {"fsdp": {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}}
    if reference is not None:
        results["fsdp"]["checksum"] = weights_checksum(reference.items())
    for label, layout in LAYOUTS.items():
        metrics, weights = one_step(model_dir, TrainerConfig(**base, backend="megatron", megatron=layout), batch)
        ps.destroy_model_parallel()
        results[label] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        if weights is not None:
            results[label]["checksum"] = weights_checksum(weights.items())
            results[label]["names"] = list(weights) == list(reference)
            results[label]["max_abs_diff"] = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
