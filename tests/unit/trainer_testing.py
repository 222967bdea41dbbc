"""Helpers shared by the trainer tests (test_train_step.py, test_stream_step.py, test_fsdp_backend.py,
test_packing.py, test_prefix.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.runtime.procs import exit_now
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.step import train_on_batch


def full_weights(backend) -> dict[str, torch.Tensor]:
    """Every weight, whole, as the float32 parameters hold it, through the backend's own gather (collective: every
    rank calls it)."""
    into = {name: torch.empty(shape, dtype=torch.float32) for name, shape, _ in backend.weight_specs()}
    backend.gather_weights(into)
    return into


def rollout_batch(backend, groups: int = 4, n: int = 4, seed: int = 0) -> TrainBatch:
    """Random prompts and responses whose rollout logprobs are the backend's own at its current weights."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len, response_len = groups * n, 5, 7
    input_ids = torch.randint(2, 20, (rows, prompt_len + response_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros(rows, prompt_len + response_len - 1)
    response_mask[:, prompt_len - 1 :] = 1.0
    with torch.no_grad():
        rollout = backend.logprobs(input_ids, attention_mask, 1.0)[0] * response_mask
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rollout_logprobs=rollout,
        rewards=torch.rand(rows, generator=g),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
        exact_rollout=torch.ones(rows, dtype=torch.bool),
    )


class GradsBackend(FSDPBackend):
    """The FSDP backend, keeping each optimizer step's gradients."""

    def step(self, max_norm: float) -> float:
        self.grads = [*getattr(self, "grads", []), [p.grad.clone() for p in self.model.parameters()]]
        return super().step(max_norm)


def trained_once(
    model_dir: str, tcfg: TrainerConfig, batch: TrainBatch, alg: AlgorithmConfig, norm_len: int
) -> tuple[GradsBackend, dict, dict]:
    """One step on ``batch`` from the model's saved weights (seed 0): the backend, its metrics, the weights before."""
    torch.manual_seed(0)
    backend = GradsBackend(ModelConfig(path=model_dir), tcfg, with_reference=False)
    before = full_weights(backend)
    metrics = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=norm_len)
    return backend, metrics, before


def update_gaps(base: tuple[GradsBackend, dict, dict], other: tuple[GradsBackend, dict, dict]) -> dict:
    """Two ``trained_once`` results from the same weights: the largest gradient and weight gaps, how far ``base``'s
    weights moved, and the loss gap."""
    (a, a_metrics, before), (b, b_metrics, _) = base, other
    w_a, w_b = full_weights(a), full_weights(b)
    return {
        "grads": max(float((x - y).abs().max()) for ga, gb in zip(a.grads, b.grads) for x, y in zip(ga, gb)),
        "weights": max(float((w_a[k] - w_b[k]).abs().max()) for k in w_a),
        "moved": max(float((w_a[k] - before[k]).abs().max()) for k in w_a),
        "loss": abs(a_metrics["loss"] - b_metrics["loss"]),
    }


def on_ranks_case(rank: int, world: int, port: int, fn: Callable[..., dict], args: tuple, out: str) -> None:
    """An ``mp.spawn`` target: ``fn(*args)`` on a gloo world of ``world`` ranks (one torch thread each); rank 0
    writes its result to ``out`` as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now(0)
