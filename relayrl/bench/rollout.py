"""``relayrl bench rollout``: one rollout worker, the same prompts as concurrent calls vs one call at a time.

Starts ``relayrl rollout serve`` (embedded hf engine, a tiny Qwen2 built here: ``--hidden``/``--layers``) and
sends ``--prompts`` prompts x ``--n`` samples as ``--calls`` Generate calls, every response exactly
``--max-tokens`` long (``ignore_eos``), alternating per round between

- ``serialized``: one call after the other, as the worker ran them before continuous batching (one call
  through the engine at a time), and
- ``concurrent``: all calls at once from their own threads, so the engine decodes their rows together.

Prints one JSON object: seconds per round and the median of each, the speed-up (serialized / concurrent),
samples/s and tokens/s, and ``logprob_parity_max``: the largest |engine logprob - plain forward logprob| over
the concurrent rounds' tokens (rows of several calls batched together must not change a logprob).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
import yaml
from transformers import AutoModelForCausalLM

from relayrl.models.tiny import write_tiny_model
from relayrl.services.channels import open_channel
from relayrl.trainer.algorithms.logprobs import logprobs_from_logits
from relayrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from relayrl.weightsync.group import free_port

Completions = list[tuple[list[int], common_pb2.Completion]]  # (prompt token ids, completion)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relayrl bench rollout", description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--calls", type=int, default=4, help="Generate calls the prompts are split into")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256, help="tiny Qwen2 hidden size")
    parser.add_argument("--layers", type=int, default=4, help="tiny Qwen2 layers")
    parser.add_argument("--threads", default="auto", help="the worker's rollout.threads")
    parser.add_argument("--workdir", type=Path, help="model, config and worker log (default: a temp dir)")
    return parser.parse_args(argv)


def start_worker(workdir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``relayrl rollout serve`` on a free port (no controller); returns the process and its address."""
    model = write_tiny_model(workdir / "model", seed=0, hidden_size=args.hidden, layers=args.layers)
    config = {
        "model": {"path": str(model)},
        "data": {"path": str(workdir / "unused.jsonl")},
        "rollout": {"max_batch_size": args.prompts * args.n, "threads": args.threads},
    }
    config_path = workdir / "bench-rollout.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "rollout.log").open("wb")
    argv = [sys.executable, "-m", "relayrl.cli", "rollout", "serve", "--config", str(config_path), "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    grpc.channel_ready_future(open_channel(address)).result(timeout=300)
    return proc, address


def prompt_ids(count: int, seed: int) -> list[list[int]]:
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


@torch.no_grad()
def logprob_parity_max(model_dir: Path, completions: Completions) -> float:
    """max |engine logprob - logprob of a plain forward of prompt + response| over every token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    worst = 0.0
    for prompt, c in completions:
        ids = torch.tensor([prompt + list(c.token_ids)])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = logprobs_from_logits(logits, torch.tensor(list(c.token_ids)), 1.0)
        worst = max(worst, float((expected - torch.tensor(list(c.logprobs))).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-rollout-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        proc, address = start_worker(workdir, args)
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(open_channel(address))
            prompts = prompt_ids(args.prompts, seed=0)
            per_call = -(-args.prompts // args.calls)
            calls = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]
            run_round(stub, calls, args, concurrent=True)  # warm-up
            seconds: dict[str, list[float]] = {"serialized": [], "concurrent": []}
            concurrent_completions: Completions = []
            for _ in range(args.rounds):
                for mode in ("serialized", "concurrent"):
                    elapsed, completions = run_round(stub, calls, args, concurrent=mode == "concurrent")
                    seconds[mode].append(elapsed)
                    if mode == "concurrent":
                        concurrent_completions += completions
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        samples = args.prompts * args.n
        median = {mode: statistics.median(values) for mode, values in seconds.items()}
        result = {
            "benchmark": "rollout",
            "workload": {k: getattr(args, k) for k in ("prompts", "n", "calls", "max_tokens", "hidden", "layers")},
            "threads": args.threads,
            "rounds": args.rounds,
            "seconds": seconds,
            "median_seconds": median,
            "speedup_concurrent_vs_serialized": median["serialized"] / median["concurrent"],
            "samples_per_second": {mode: samples / s for mode, s in median.items()},
            "tokens_per_second": {mode: samples * args.max_tokens / s for mode, s in median.items()},
            "logprob_parity_max": logprob_parity_max(workdir / "model", concurrent_completions),
        }
    print(json.dumps(result, indent=2))
    return 0
