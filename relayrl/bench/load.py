"""``relayrl bench load``: N concurrent clients submit prompt batches (SubmitPrompts) for a bounded time.

Without ``--controller`` it starts its own controller and ``--workers`` rollout workers (embedded hf engine,
the tiny demo model unless ``--config`` names another) as local processes on loopback. Every client sends
one request after the other, each with a deadline; requests that start during the ``--warmup`` seconds are
not counted. Prints one JSON object: requests, errors (by status code), p50/p99/max latency, throughput, and
the controller's resident memory at the end of the warm-up and after the run (when its process is known:
started here, or ``--controller-pid``). Exit code 1 when any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from relayrl.bench.cluster import local_cluster
from relayrl.bench.record import machine_record, run_sides
from relayrl.config import load_config
from relayrl.models.assets import prepare_assets
from relayrl.ops.args import OneLineParser, address, existing_dir, existing_file, positive_int
from relayrl.rpc.channels import configure_client, open_channel
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc

Prompt = controller_pb2.SubmitPromptsRequest.Prompt


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic()
    seconds: float
    code: str  # grpc status name, "OK" on success
    completions: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="relayrl bench load", description=__doc__)
    parser.add_argument("--controller", type=address, help="address of a running controller (default: start one here)")
    parser.add_argument("--controller-pid", type=int, help="its process id, for the memory readings")
    parser.add_argument("--config", type=existing_file, help="run config (default: the tiny demo model, built here)")
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="rollout workers to start (without --controller)"
    )
    parser.add_argument("--clients", type=positive_int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per request")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=120.0, help="deadline of each request, seconds")
    parser.add_argument(
        "--workdir", type=existing_dir, help="where the demo model, data and logs go (default: a temp dir)"
    )
    return parser.parse_args(argv)


def demo_config(workdir: Path, args: argparse.Namespace) -> Path:
    """A config for the tiny demo model and the digits data (built on first use) under ``workdir``."""
    raw = {
        "run": {"name": "bench-load", "dir": str(workdir / "runs")},
        "model": {"path": "builtin:tiny-qwen2"},
        "data": {"path": "builtin:digits"},
        "rollout": {"n": max(2, args.n), "max_tokens": max(2, args.max_tokens)},
        "controller": {"prompts_per_gen_batch": 2, "train_batch_groups": 2, "reward": {"fn": "prefix_match"}},
        "trainer": {"mini_batches": 1},
    }
    path = workdir / "bench-load.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def rss_mib(pid: int | None, field: str = "VmRSS") -> float | None:
    """Resident memory of ``pid`` from /proc, in MiB (``field="VmHWM"``: its peak so far); None when unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def make_request(rng: random.Random, args: argparse.Namespace) -> controller_pb2.SubmitPromptsRequest:
    digits = [rng.randrange(10) for _ in range(args.prompts)]
    return controller_pb2.SubmitPromptsRequest(
        prompts=[Prompt(text=f"{d} + 1 =", answer=str((d + 1) % 10)) for d in digits],
        params=common_pb2.SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens),
        reward_fn="prefix_match",
    )


def client_loop(address: str, seed: int, stop_at: float, args: argparse.Namespace, out: list[Outcome]) -> None:
    """Submit requests back to back until ``stop_at``; one Outcome per request (list.append is thread-safe)."""
    stub = controller_pb2_grpc.ControllerServiceStub(open_channel(address))
    rng = random.Random(seed)
    while (started := time.monotonic()) < stop_at:
        request = make_request(rng, args)
        try:
            count = sum(1 for _ in stub.SubmitPrompts(request, timeout=args.deadline))
            code = "OK" if count == args.prompts * args.n else "INCOMPLETE"
        except grpc.RpcError as err:
            count, code = 0, err.code().name
        out.append(Outcome(started, time.monotonic() - started, code, count))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))]


def run_load(address: str, pid: int | None, args: argparse.Namespace) -> dict:
    outcomes: list[Outcome] = []
    began = time.monotonic()
    measure_from, stop_at = began + args.warmup, began + args.warmup + args.duration
    threads = [
        threading.Thread(target=client_loop, args=(address, i, stop_at, args, outcomes), daemon=True)
        for i in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, measure_from - time.monotonic()))
    rss_before = rss_mib(pid)
    for thread in threads:
        thread.join()
    finished = time.monotonic()
    rss_after = rss_mib(pid)
    measured = [o for o in outcomes if o.started >= measure_from]
    latencies = sorted(o.seconds for o in measured if o.code == "OK")
    errors = Counter(o.code for o in outcomes if o.code != "OK")
    elapsed = finished - measure_from
    return {
        "clients": args.clients,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "prompts_per_request": args.prompts,
        "samples_per_prompt": args.n,
        "max_tokens": args.max_tokens,
        "requests": len(measured),
        "errors": sum(errors.values()),
        "errors_by_code": dict(errors),
        "latency_p50_s": round(percentile(latencies, 50), 4),
        "latency_p99_s": round(percentile(latencies, 99), 4),
        "latency_max_s": round(latencies[-1] if latencies else 0.0, 4),
        "requests_per_second": round(len(latencies) / elapsed, 2),
        "completions_per_second": round(sum(o.completions for o in measured) / elapsed, 1),
        "controller_rss_mib_before": None if rss_before is None else round(rss_before, 1),
        "controller_rss_mib_after": None if rss_after is None else round(rss_after, 1),
        "controller_rss_growth": None if not (rss_before and rss_after) else round(rss_after / rss_before - 1, 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.config is not None:
        configure_client(load_config(args.config).security)
    machine = machine_record(None)
    if args.controller:
        result = run_load(args.controller, args.controller_pid, args)
    else:
        with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
            workdir = Path(args.workdir or tmp)
            config_path = args.config or demo_config(workdir, args)
            prepare_assets(load_config(config_path))
            print(
                f"starting a controller and {args.workers} rollout workers (logs in {workdir / 'logs'})",
                file=sys.stderr,
            )
            with local_cluster(config_path, args.workers, workdir / "logs") as cluster:
                result = {"workers": args.workers, **run_load(cluster.controller, cluster.controller_pid, args)}
            machine["resolved"] = run_sides(workdir / "logs")
    result["machine"] = machine | {"loadavg_at_end": list(os.getloadavg())}
    print(json.dumps(result, indent=1))
    return 1 if result["errors"] else 0
