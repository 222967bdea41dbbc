"""``relayrl bench padding``: one trainer step padding-free against the same step padded, on one long-tail batch.

The batch: ``--groups`` prompts of the digits task x ``--n`` responses whose lengths are geometric with mean
``--mean-length`` tokens, capped at ``--max-tokens`` (a few rows run to the cap, so the padded batch is as wide as
its longest row), random rewards. The model: ``write_long_tail_model`` (tiny Qwen2, ``--hidden`` x ``--layers``).
Each round trains the step from the same starting weights with ``trainer.padding_free`` off, then on (the order
alternates between rounds; ``trainer.shared_prefix`` off in both, so they differ in packing alone), in a trainer
world of one rank on this process: FSDP backend, ``--mini-batches``
optimizer steps, old logprobs the engine's (the K = 0 path). Prints one JSON object: the batch's shape (rows, real
tokens, padded positions, padding share, the positions each mode's forwards computed), seconds per step of each
mode (median over rounds, and every round), ``speedup`` (padded / padding-free, per round and the median), the same
for the process's CPU seconds (``cpu_seconds_per_step``, ``cpu_speedup``: on a shared machine, where the step waits
for a core, steadier than wall seconds; exact with ``--threads 1``), and the update's agreement: the largest
|padded - padding-free| weight difference after the step against the largest change the step made.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from relayrl.bench.record import machine_record, model_side
from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.data.digits import digits_rows
from relayrl.models.tiny import write_long_tail_model
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import TrainBatch, to_train_batch
from relayrl.trainer.step import train_on_batch
from relayrl.v1 import common_pb2, controller_pb2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relayrl bench padding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16, help="prompts (GRPO groups) in the batch")
    parser.add_argument("--n", type=int, default=16, help="responses per prompt")
    parser.add_argument("--mean-length", type=int, default=48, help="mean response length (geometric)")
    parser.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    parser.add_argument("--hidden", type=int, default=256, help="model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="model layers")
    parser.add_argument("--mini-batches", type=int, default=2, help="optimizer steps in the step")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each trains both modes once")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every usable CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where the model is written (default: a new temp dir)")
    args = parser.parse_args(argv)
    if min(args.groups, args.n, args.mean_length, args.max_tokens, args.rounds, args.mini_batches) < 1:
        parser.error("--groups, --n, --mean-length, --max-tokens, --rounds and --mini-batches must be >= 1")
    if args.mini_batches > args.groups:
        parser.error("--mini-batches must not exceed --groups (a mini-batch holds whole groups)")
    return args


def long_tail_batch(tokenizer, args: argparse.Namespace) -> TrainBatch:
    """Digits prompts x geometric response lengths (random tokens, EOS last unless capped), random rewards; the
    engine's logprobs are those of the near-uniform model, log(1 / vocabulary) (exact: the K = 0 path)."""
    g = torch.Generator().manual_seed(args.seed)
    vocab = len(tokenizer)
    samples = []
    for group, row in enumerate(digits_rows(args.groups, seed=args.seed)):
        prompt = tokenizer(row["prompt"]).input_ids
        for _ in range(args.n):
            length = min(args.max_tokens, geometric(args.mean_length, g))
            response = torch.randint(3, vocab, (length,), generator=g).tolist()
            if length < args.max_tokens:
                response[-1] = tokenizer.eos_token_id
            samples.append(
                controller_pb2.Sample(
                    prompt_id=str(group), group=group, prompt_token_ids=prompt, response_token_ids=response,
                    rollout_logprobs=[-float(torch.log(torch.tensor(float(vocab))))] * length,
                    reward=float(torch.rand(1, generator=g)), worker_id="bench",
                    finish_reason=common_pb2.FINISH_REASON_STOP if length < args.max_tokens
                    else common_pb2.FINISH_REASON_LENGTH,
                )
            )  # fmt: skip
    return to_train_batch(samples, tokenizer.pad_token_id, version=0, verified_workers=frozenset({"bench"}))


def geometric(mean: float, generator: torch.Generator) -> int:
    """A draw of the geometric distribution on 1, 2, ... with mean ``mean`` (by inversion: ceil(log u / log(1 - p)),
    p = 1 / mean)."""
    u = float(torch.rand(1, generator=generator).clamp(min=1e-12))
    return max(1, math.ceil(math.log(u) / math.log(1 - 1 / mean))) if mean > 1 else 1


def train_once(
    model_dir: Path, batch: TrainBatch, mode: str, args: argparse.Namespace
) -> tuple[float, float, dict, float, dict]:
    """One step from the model's saved weights with ``trainer.padding_free`` ``mode``: (wall seconds, CPU seconds
    of this process, weights after, the step's ``padding_share`` metric: padding in the positions computed, the
    precision and attention it resolved)."""
    tcfg = TrainerConfig(lr=1e-3, mini_batches=args.mini_batches, padding_free=mode, shared_prefix="off")
    torch.manual_seed(args.seed)
    backend = FSDPBackend(ModelConfig(path=str(model_dir)), tcfg, with_reference=False)
    began, cpu = time.perf_counter(), time.process_time()
    metrics = train_on_batch(backend, batch, AlgorithmConfig(), tcfg, temperature=1.0, norm_len=args.max_tokens)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    weights = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    return seconds, cpu, weights, metrics["padding_share"], model_side(backend.model, backend.precision.compute)


def run_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    machine = machine_record({})  # each mode's resolved precision and attention filled in as it runs
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="relayrl-bench-padding-"))
    model_dir = write_long_tail_model(
        workdir / "long-tail-model", mean_length=args.mean_length, hidden_size=args.hidden, layers=args.layers
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = long_tail_batch(tokenizer, args)
    start = {name: p.clone() for name, p in FSDPBackend(
        ModelConfig(path=str(model_dir)), TrainerConfig(), with_reference=False).model.named_parameters()}  # fmt: skip
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    weights: dict[str, dict] = {}
    padding: dict[str, float] = {}
    for rnd in range(args.rounds):
        for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
            took, used, weights[mode], padding[mode], side = train_once(model_dir, batch, mode, args)
            machine["resolved"][{"off": "padded", "on": "padding_free"}[mode]] = side
            seconds[mode].append(took)
            cpu[mode].append(used)
    tokens = int(batch.attention_mask.sum())
    positions = batch.attention_mask.numel()
    speedups = [off / on for off, on in zip(seconds["off"], seconds["on"])]
    cpu_speedups = [off / on for off, on in zip(cpu["off"], cpu["on"])]
    shape = {
        "rows": len(batch),
        "width": batch.input_ids.shape[1],
        "real_tokens": tokens,
        "padded_positions": positions,
        "padding_share": 1 - tokens / positions,
        "response_len_mean": float(batch.response_mask.sum()) / len(batch),
        "response_len_max": int(batch.response_mask.sum(-1).max()),
        # per mode: real tokens / (1 - the step's padding share), both of its mini-batches' forwards together
        "positions_computed": {
            "padded": round(tokens / (1 - padding["off"])),
            "padding_free": round(tokens / (1 - padding["on"])),
        },
    }
    settings = {k: v for k, v in vars(args).items() if k != "workdir"}
    return {
        "bench": "padding",
        "batch": shape,
        "settings": settings | {"torch_threads": torch.get_num_threads()},
        "seconds_per_step": {
            "padded": statistics.median(seconds["off"]),
            "padding_free": statistics.median(seconds["on"]),
        },
        "seconds_by_round": {"padded": seconds["off"], "padding_free": seconds["on"]},
        "speedup": statistics.median(speedups),
        "speedup_by_round": speedups,
        "cpu_seconds_per_step": {"padded": statistics.median(cpu["off"]), "padding_free": statistics.median(cpu["on"])},
        "cpu_seconds_by_round": {"padded": cpu["off"], "padding_free": cpu["on"]},
        "cpu_speedup": statistics.median(cpu_speedups),
        "cpu_speedup_by_round": cpu_speedups,
        "update": {
            "weights_max_diff": max(float((weights["off"][k] - weights["on"][k]).abs().max()) for k in start),
            "moved_max": max(float((weights["off"][k] - start[k]).abs().max()) for k in start),
        },
        "machine": machine | {"loadavg_at_end": list(os.getloadavg())},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(json.dumps(run_bench(args), indent=1))
    finally:
        dist.destroy_process_group()
    return 0
