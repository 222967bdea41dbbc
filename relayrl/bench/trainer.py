"""``relayrl bench trainer``: one GRPO trainer step on a real model, float32 as before against the trainer of today.

The batch: ``--prompts`` GRPO groups of ``--n`` rows of random tokens, a group's rows one prompt of
~``--prompt-tokens`` and each its own response of ~``--response-tokens`` (each +-20 %, uniform), random rewards,
the engine's logprobs the float32 trainer's own (the K = 0 path: old logprobs from the engine, ratio ~1). Modes,
each a trainer world of one rank on this process (FSDP backend, one optimizer step, from the model's saved
weights, AdamW's state already allocated as in every step of a run but the first, rows padded), alternating
order round by round:
- ``float32_full_logits``: the trainer before mixed precision and the chunked head: float32 matmuls, every
  position's float32 [rows, length, vocab] logits and their gradient (``FullLogitsBackend``);
- ``float32``: float32 compute, the response positions alone through the head in chunks (relayrl/trainer/head.py);
- ``bfloat16``: the same under bf16 autocast (float32 parameters and optimizer state);
- ``bfloat16_shared_prefix``: the same with each group's prompt forwarded once (relayrl/trainer/prefix.py).
A mode's loss, gradient norm and entropy are within ``TOLERANCE`` of ``float32_full_logits``'s, each relative to
the quantity it bounds, or ``within_tolerance`` says which is not. ``machine`` is the fairness record
(relayrl/bench/record.py), each mode's resolved precision and attention in it.
Prints one JSON object: the batch's shape, seconds per step of each mode (median over rounds, and every round),
microseconds per token (real tokens of the batch), ``speedup`` against ``float32_full_logits`` (per round and the
median), the same for the process's CPU seconds (on a shared machine, where a step also waits for a core, steadier
than wall seconds; exact with ``--threads 1``), each mode's step metrics (loss, grad norm, entropy, logprob mismatch
and the rollout-correction diagnostics ``rollout_corr/*`` against the float32 logprobs) and their gap to
``float32_full_logits``, and, with ``--profile``, where one more step of each mode spent its CPU time
(torch.profiler: the top operators by self time, and shares by kind).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.algorithms import compute_advantages
from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from relayrl.bench.record import machine_record, model_side
from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.step import train_on_batch

MODES = ("float32_full_logits", "float32", "bfloat16", "bfloat16_shared_prefix")
# A mode's step against float32_full_logits, each gap relative to what it measures: |loss gap| / loss_scale (the
# token mean of |advantage|: the loss is a token mean of -ratio x advantage terms, which cancel to near 0 with
# random rewards, so the loss itself is no scale for its error; 0.01 was 2.6x the loss), |grad norm gap| / grad
# norm and |entropy gap| / entropy. bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2 % a value),
# compounded over 30 layers forward and back; its per-token logprob error (logprob_mismatch) averages out over the
# batch's tokens in the loss (measured on SmolLM2-135M: loss 0.1 %, grad norm 0.04 % and 0.74 % with shared
# prompts, entropy 0.04 %).
TOLERANCE = {"loss_rel": 0.01, "grad_norm_rel": 0.02, "entropy_rel": 0.002}
CORRECTION_METRICS = ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "log_ppl_diff", "ess")
METRICS = ("loss", "grad_norm", "entropy", "logprob_mismatch", "logprob_mismatch_max", "clip_frac",
           *(f"rollout_corr/{k}" for k in CORRECTION_METRICS))  # fmt: skip
# torch.profiler operator names by kind, first match wins ("other": the rest)
KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_weight_int"),
    "attention": ("scaled_dot_product", "_flash_attention", "_efficient_attention", "aten::_softmax"),
    "log_softmax_and_head": ("logsumexp", "log_softmax", "aten::exp", "aten::gather", "aten::scatter", "softmax"),
    "optimizer": ("_fused_adamw", "adam", "Optimizer.step"),
    "dtype_casts": ("aten::to", "aten::_to_copy", "aten::copy_"),
    "elementwise": ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu", "aten::pow", "aten::rsqrt",
                    "aten::mean", "aten::sum", "aten::neg", "aten::cat", "aten::where", "aten::fill_", "aten::zero_"),
}  # fmt: skip


class FullLogitsBackend(FSDPBackend):
    """The trainer before mixed precision and the chunked head: every position's logits through the model's own
    head (float32 [rows, length, vocab], kept for backward with their gradient), then the shared functions."""

    def _logprobs(self, model, input_ids, attention_mask, scored, temperature, dtype, groups):
        logits = model(input_ids=input_ids.to(self.device)).logits[:, :-1]  # right-padded: causal attention alone
        labels = input_ids[:, 1:].to(self.device)
        return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relayrl bench trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (a real model)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (GRPO groups) in the batch")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=40, help="mean prompt length")
    parser.add_argument("--response-tokens", type=int, default=25, help="mean response length")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each trains every mode once")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every usable CPU)")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.prompts, args.n, args.prompt_tokens, args.response_tokens, args.rounds) < 1:
        parser.error("--prompts, --n, --prompt-tokens, --response-tokens and --rounds must be >= 1")
    return args


def make_batch(vocab: int, args: argparse.Namespace) -> TrainBatch:
    """Random rows right-padded to the longest (module docstring); rollout logprobs filled in by ``main``."""
    g = torch.Generator().manual_seed(args.seed)

    def around(mean: int) -> int:
        return max(1, round(mean * float(0.8 + 0.4 * torch.rand(1, generator=g))))

    prompts = [torch.randint(3, vocab, (around(args.prompt_tokens),), generator=g) for _ in range(args.prompts)]
    rows = [(prompt, around(args.response_tokens)) for prompt in prompts for _ in range(args.n)]
    width = max(len(prompt) + r for prompt, r in rows)
    count = len(rows)
    input_ids = torch.zeros(count, width, dtype=torch.long)
    attention_mask = torch.zeros(count, width, dtype=torch.long)
    response_mask = torch.zeros(count, width - 1)
    for i, (prompt, r) in enumerate(rows):
        p = len(prompt)
        input_ids[i, : p + r] = torch.cat([prompt, torch.randint(3, vocab, (r,), generator=g)])
        attention_mask[i, : p + r] = 1
        response_mask[i, p - 1 : p + r - 1] = 1.0
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_logprobs=torch.zeros(count, width - 1),
        teacher_logprobs=torch.zeros(count, width - 1),
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rewards=torch.rand(count, generator=g),
        scores=torch.zeros(count),
        group_ids=torch.arange(args.prompts).repeat_interleave(args.n),
        truncated=torch.zeros(count, dtype=torch.bool),
        versions=torch.zeros(count, dtype=torch.long),
        exact_rollout=torch.ones(count, dtype=torch.bool),
    )


def backend_for(mode: str, model: str) -> tuple[FSDPBackend, TrainerConfig]:
    tcfg = TrainerConfig(
        lr=1e-6, precision="float32" if mode.startswith("float32") else "bfloat16", padding_free="off",
        shared_prefix="on" if mode == "bfloat16_shared_prefix" else "off",
    )  # fmt: skip
    kind = FullLogitsBackend if mode == "float32_full_logits" else FSDPBackend
    return kind(ModelConfig(path=model), tcfg, with_reference=False), tcfg


def step(mode: str, batch: TrainBatch, args: argparse.Namespace, profile: bool = False) -> tuple[float, float, dict]:
    """One step of ``mode`` from the saved weights: (wall seconds, CPU seconds of this process, its metrics; with
    ``profile`` also ``where_time_went`` of it under "profile")."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    torch.manual_seed(args.seed)
    backend, tcfg = backend_for(mode, args.model)
    warm_optimizer(backend)
    context = profiler(activities=[ProfilerActivity.CPU]) if profile else contextlib.nullcontext()
    began, cpu = time.perf_counter(), time.process_time()
    with context as prof:
        metrics = train_on_batch(backend, batch, AlgorithmConfig(), tcfg, temperature=1.0, norm_len=1)
    took, cpu = time.perf_counter() - began, time.process_time() - cpu
    metrics["resolved"] = model_side(backend.model, backend.precision.compute)
    del backend
    gc.collect()  # the model, its gradients and AdamW state go before the next mode's load
    return took, cpu, metrics | ({"profile": where_time_went(prof)} if profile else {})


def warm_optimizer(backend: FSDPBackend) -> None:
    """AdamW's state allocated, as in every step of a run but its first: a step on zero gradients, which moves no
    weight (weight decay 0). Without it the timed step would pay for paging in 1 GB of fresh zeroed moments."""
    for param in backend.trainable:
        param.grad = torch.zeros_like(param)
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)


def where_time_went(profiler) -> dict:
    """The profile's operators by self CPU time: the top 12 and the shares by kind (``KINDS``)."""
    events = [e for e in profiler.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        kind = next((k for k, names in KINDS.items() if any(n in e.key for n in names)), "other")
        by_kind[kind] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "self_cpu_seconds": total / 1e6,
        "share_by_kind": {k: round(v / total, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_operators": [
            {"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count} for e in top
        ],
    }


def loss_scale(batch: TrainBatch) -> float:
    """The token mean of |advantage| (GRPO's, as the step computes it): the size of the loss's terms."""
    advantages = compute_advantages(AlgorithmConfig().advantage, batch.rewards, batch.group_ids).abs()
    per_token = advantages[:, None] * batch.response_mask
    return float(per_token.sum() / batch.response_mask.sum())


def relative_gaps(metrics: dict, base: dict, scale: float) -> dict[str, float]:
    """A step's gaps to the baseline's, each relative to what it measures (``TOLERANCE``'s comment)."""
    return {
        "loss_rel": abs(metrics["loss"] - base["loss"]) / scale,
        "grad_norm_rel": abs(metrics["grad_norm"] - base["grad_norm"]) / max(abs(base["grad_norm"]), 1e-12),
        "entropy_rel": abs(metrics["entropy"] - base["entropy"]) / max(abs(base["entropy"]), 1e-12),
    }


def within_tolerance(gaps: dict[str, float]) -> bool:
    """Whether every relative gap is within ``TOLERANCE``."""
    return all(gaps[key] <= bound for key, bound in TOLERANCE.items())


def command(args: argparse.Namespace) -> str:
    """The command line that runs this bench again with ``args``."""
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()]
    flags = [flag for flag, v in zip(flags, vars(args).values()) if v is not False]
    return "relayrl bench trainer " + " ".join(flags)


def run_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    machine = machine_record({})  # each mode's resolved precision and attention filled in as it runs
    reference, _ = backend_for("float32", args.model)
    batch = make_batch(reference.model.config.vocab_size, args)
    with torch.no_grad():  # the engine's logprobs: the float32 trainer's own (exact rollout)
        batch.rollout_logprobs = reference.logprobs(batch.input_ids, batch.attention_mask, 1.0)[0] * batch.response_mask
    del reference
    gc.collect()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    metrics: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            took, used, metrics[mode] = step(mode, batch, args)
            seconds[mode].append(took)
            cpu[mode].append(used)
    tokens = int(batch.attention_mask.sum())
    scale = loss_scale(batch)
    machine["resolved"] = {mode: metrics[mode].pop("resolved") for mode in MODES}
    gaps = {mode: relative_gaps(metrics[mode], metrics[MODES[0]], scale) for mode in MODES[1:]}
    median = {mode: statistics.median(seconds[mode]) for mode in MODES}
    base = MODES[0]
    speedups = {m: [b / s for b, s in zip(seconds[base], seconds[m])] for m in MODES[1:]}
    cpu_speedups = {m: [b / s for b, s in zip(cpu[base], cpu[m])] for m in MODES[1:]}
    result = {
        "bench": "trainer",
        "command": command(args),
        "batch": {
            "rows": len(batch),
            "width": batch.input_ids.shape[1],
            "real_tokens": tokens,
            "response_tokens": int(batch.response_mask.sum()),
            "padding_share": 1 - tokens / batch.attention_mask.numel(),
        },
        "settings": vars(args) | {"torch_threads": torch.get_num_threads()},
        "seconds_per_step": median,
        "seconds_by_round": seconds,
        "us_per_token": {mode: 1e6 * median[mode] / tokens for mode in MODES},
        "speedup_vs_float32_full_logits": {m: statistics.median(v) for m, v in speedups.items()},
        "speedup_by_round": speedups,
        "cpu_seconds_per_step": {mode: statistics.median(cpu[mode]) for mode in MODES},
        "cpu_seconds_by_round": cpu,
        "cpu_speedup_vs_float32_full_logits": {m: statistics.median(v) for m, v in cpu_speedups.items()},
        "cpu_speedup_by_round": cpu_speedups,
        "metrics": {mode: {k: metrics[mode][k] for k in METRICS} for mode in MODES},
        "metrics_gap_vs_float32_full_logits": {
            mode: {k: metrics[mode][k] - metrics[base][k] for k in ("loss", "grad_norm", "entropy")}
            for mode in MODES[1:]
        },
        "loss_scale": scale,
        "relative_gaps_vs_float32_full_logits": gaps,
        "tolerance": TOLERANCE,
        "within_tolerance": {mode: within_tolerance(gaps[mode]) for mode in MODES[1:]},
        "machine": machine | {"loadavg_at_end": list(os.getloadavg())},
    }
    if args.profile:
        result["profile"] = {mode: step(mode, batch, args, profile=True)[2]["profile"] for mode in MODES}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.model).is_dir():
        raise SystemExit(f"--model: {args.model} is not a directory")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(json.dumps(run_bench(args), indent=1))
    finally:
        dist.destroy_process_group()
    return 0
