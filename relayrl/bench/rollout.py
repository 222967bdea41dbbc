"""``relayrl bench rollout``: one rollout worker, the same prompts as concurrent calls vs one call at a time,
for each decode runner of the hf engine.

Starts one ``relayrl rollout serve`` per ``--hf-decode`` value (embedded hf engine with that
``rollout.hf_decode`` and float32 weights, a tiny Qwen2 built here: ``--hidden``/``--layers``) and sends
``--prompts`` prompts x ``--n`` samples as ``--calls`` Generate calls, every response exactly ``--max-tokens``
long (``ignore_eos``), alternating per round over the workers and, for each, between

- ``serialized``: one call after the other, as the worker ran them before continuous batching (one call
  through the engine at a time), and
- ``concurrent``: all calls at once from their own threads, so the engine decodes their rows together.

Prints one JSON object, its figures keyed by hf_decode value (then by mode): the runner each worker logged it
chose, seconds per round and the median of each, the speed-up (serialized / concurrent),
``speedup_vs_transformers`` (the transformers runner's median / this one's, same mode: the fast runner's gain),
samples/s and tokens/s, the worker process's CPU seconds per round (``worker_cpu_seconds``, read from /proc:
steadier than wall seconds on a shared machine, where a worker may wait for a core) and their ratio
``cpu_speedup_vs_transformers``, and ``logprob_parity_max``: the largest |engine logprob - plain forward
logprob| over the concurrent rounds' tokens (rows of several calls batched together must not change a logprob).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import yaml

from relayrl.bench.cpu import cpu_seconds
from relayrl.bench.record import machine_record, run_sides
from relayrl.ops.args import OneLineParser, existing_dir, positive_int
from relayrl.rpc.channels import open_channel
from relayrl.runtime.ports import free_port
from relayrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

Completions = list[tuple[list[int], common_pb2.Completion]]  # (prompt token ids, completion)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="relayrl bench rollout", description=__doc__)
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--n", type=positive_int, default=16, help="samples per prompt")
    parser.add_argument("--calls", type=positive_int, default=4, help="Generate calls the prompts are split into")
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--hidden", type=positive_int, default=256, help="tiny Qwen2 hidden size")
    parser.add_argument("--layers", type=positive_int, default=4, help="tiny Qwen2 layers")
    parser.add_argument("--threads", default="auto", help="the worker's rollout.threads")
    parser.add_argument(
        "--hf-decode", default="auto,transformers", help="comma-separated rollout.hf_decode values, one worker each"
    )
    parser.add_argument("--workdir", type=existing_dir, help="model, config and worker log (default: a temp dir)")
    return parser.parse_args(argv)


def start_worker(workdir: Path, args: argparse.Namespace, decode: str) -> tuple[subprocess.Popen, str]:
    """``relayrl rollout serve`` with ``rollout.hf_decode=decode`` on a free port (no controller; log in
    ``rollout-<decode>.log``); returns the process and its address."""
    from relayrl.models.tiny import write_tiny_model  # torch and transformers: after the flags are checked

    model = workdir / "model"
    if not model.exists():
        write_tiny_model(model, seed=0, hidden_size=args.hidden, layers=args.layers)
    # float32 weights: logprob_parity_max compares with a float32 plain forward (the default follows the trainer's
    # compute dtype, bf16 on a CPU with AMX/AVX512-BF16, where rounding and not batching would set the gap)
    rollout = {"max_batch_size": args.prompts * args.n, "threads": args.threads, "hf_decode": decode}
    rollout["weight_dtype"] = "float32"
    config = {"model": {"path": str(model)}, "data": {"path": str(workdir / "unused.jsonl")}, "rollout": rollout}
    config_path = workdir / f"bench-rollout-{decode}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / f"rollout-{decode}.log").open("wb")
    argv = [sys.executable, "-m", "relayrl.cli", "rollout", "serve", "--config", str(config_path), "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    grpc.channel_ready_future(open_channel(address)).result(timeout=300)
    return proc, address


def chosen_runner(log_path: Path) -> str:
    """The runner the worker's hf engine logged it decodes with: "fast", "transformers" or "unknown"."""
    text = log_path.read_text(errors="replace")
    if "decoding with the fast" in text:
        return "fast"
    return "transformers" if "decoding with the transformers" in text else "unknown"


def prompt_ids(count: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 15, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def generate(stub, prompts: list[list[int]], args: argparse.Namespace, offset: int) -> Completions:
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id=str(offset + i), token_ids=p) for i, p in enumerate(prompts)],
        params=common_pb2.SamplingParams(
            n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, ignore_eos=True
        ),
    )
    responses = stub.Generate(request, timeout=600)
    return [(prompts[int(c.prompt_id) - offset], c) for r in responses for c in r.completions]


def run_round(
    stub, calls: list[list[list[int]]], args: argparse.Namespace, concurrent: bool
) -> tuple[float, Completions]:
    """Seconds for every call to finish, and every completion."""
    results: list[Completions] = [[] for _ in calls]
    offsets = [sum(len(c) for c in calls[:i]) for i in range(len(calls))]

    def one(i: int) -> None:
        results[i] = generate(stub, calls[i], args, offsets[i])

    start = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(calls)):
            one(i)
    return time.perf_counter() - start, [c for r in results for c in r]


def logprob_parity_max(model_dir: Path, completions: Completions) -> float:
    """max |engine logprob - logprob of a plain forward of prompt + response| over every token."""
    import torch
    from transformers import AutoModelForCausalLM

    from relayrl.algorithms.logprobs import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    worst = 0.0
    with torch.no_grad():
        for prompt, c in completions:
            ids = torch.tensor([prompt + list(c.token_ids)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            expected = logprobs_from_logits(logits, torch.tensor(list(c.token_ids)), 1.0)
            worst = max(worst, float((expected - torch.tensor(list(c.logprobs))).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    decodes = args.hf_decode.split(",")
    modes = ("serialized", "concurrent")
    machine = machine_record(None)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-rollout-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        workers: dict[str, tuple[subprocess.Popen, str]] = {}
        seconds = {decode: {mode: [] for mode in modes} for decode in decodes}
        cpu = {decode: {mode: [] for mode in modes} for decode in decodes}
        concurrent_completions: dict[str, Completions] = {decode: [] for decode in decodes}
        try:
            for decode in decodes:
                workers[decode] = start_worker(workdir, args, decode)
            stubs = {d: rollout_pb2_grpc.RolloutServiceStub(open_channel(a)) for d, (_, a) in workers.items()}
            prompts = prompt_ids(args.prompts, seed=0)
            per_call = -(-args.prompts // args.calls)
            calls = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]
            for stub in stubs.values():
                run_round(stub, calls, args, concurrent=True)  # warm-up
            for _ in range(args.rounds):
                for decode, stub in stubs.items():
                    for mode in modes:
                        cpu_before = cpu_seconds(workers[decode][0].pid)
                        elapsed, completions = run_round(stub, calls, args, concurrent=mode == "concurrent")
                        seconds[decode][mode].append(elapsed)
                        cpu[decode][mode].append(cpu_seconds(workers[decode][0].pid) - cpu_before)
                        if mode == "concurrent":
                            concurrent_completions[decode] += completions
        finally:
            for proc, _ in workers.values():
                proc.terminate()
                proc.wait(timeout=60)
        samples = args.prompts * args.n
        median = {d: {mode: statistics.median(values) for mode, values in s.items()} for d, s in seconds.items()}
        median_cpu = {d: {mode: statistics.median(values) for mode, values in s.items()} for d, s in cpu.items()}
        result = {
            "benchmark": "rollout",
            "workload": {k: getattr(args, k) for k in ("prompts", "n", "calls", "max_tokens", "hidden", "layers")},
            "threads": args.threads,
            "rounds": args.rounds,
            "hf_decode": decodes,
            "runner_chosen": {d: chosen_runner(workdir / f"rollout-{d}.log") for d in decodes},
            "machine": machine | {"resolved": run_sides(workdir), "loadavg_at_end": list(os.getloadavg())},
            "seconds": seconds,
            "median_seconds": median,
            "speedup_concurrent_vs_serialized": {d: m["serialized"] / m["concurrent"] for d, m in median.items()},
            "samples_per_second": {d: {mode: samples / s for mode, s in m.items()} for d, m in median.items()},
            "tokens_per_second": {
                d: {mode: samples * args.max_tokens / s for mode, s in m.items()} for d, m in median.items()
            },
            "worker_cpu_seconds": cpu,
            "median_worker_cpu_seconds": median_cpu,
            "logprob_parity_max": {
                d: logprob_parity_max(workdir / "model", completions)
                for d, completions in concurrent_completions.items()
            },
        }
        if "transformers" in median:
            for key, medians in (("speedup_vs_transformers", median), ("cpu_speedup_vs_transformers", median_cpu)):
                base = medians["transformers"]
                result[key] = {
                    d: {mode: base[mode] / max(s, 1e-9) for mode, s in m.items()} for d, m in medians.items()
                }
    print(json.dumps(result, indent=2))
    return 0
