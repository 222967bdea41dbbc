"""``relayrl bench controller``: the control plane at scale, with simulated rollout workers and a simulated trainer.

A real controller process (``relayrl controller serve``, real gRPC, its /metrics on) serves ``--workers``
simulated rollout workers (``relayrl.bench.simulated_workers``: a few processes, one endpoint per worker id,
instant canned completions, a heartbeat per worker as often as the controller asks) and one simulated trainer (this
process: PullBatch, GetWeightSyncPlan, a simulated weight update, ReportStep, step after step, no training).
Everything the controller does for a real run happens: dispatch by load over every worker, rewards (decode +
reward function), DAPO dynamic sampling, the staleness bound, the ledger on disk, batch assembly and
persistence, per-step version bookkeeping, heartbeats and the Stats poll of every worker.

The controller starts paused (it was paused before any worker registered, so the simulated workers are not);
once every simulated worker is registered the baseline runs, then the clock starts at Resume and stops
when the trainer has pulled batches holding ``--trajectories`` generated trajectories (every trajectory that was
dispatched, scored and went through dynamic sampling; ``trained`` counts those in the batches).

Baseline, same run, same simulated workers: ``bare``, the same Generate calls (same chunks, as many at once as
one generation round of the controller dispatches) from a plain gRPC client that only counts what comes back, i.e.
what the transport alone allows on this machine.

Prints one JSON object (``--json``) or a short summary: trajectories/s, the Generate round trip as the
controller sees it (p50/p99, from its ``relayrl_generate_seconds`` histogram), controller RSS at start and at
its peak, controller CPU seconds (and per trajectory), and the CPU share the paused controller spends on its
fleet alone (heartbeats, Stats polls) before the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from relayrl.bench.load import rss_mib
from relayrl.bench.record import machine_record
from relayrl.bench.simulated_workers import VersionFile, canned_responses
from relayrl.client.workers import WORKER_CHANNEL_OPTIONS
from relayrl.config import ControllerConfig, load_config
from relayrl.errors import rpc_error_text
from relayrl.launcher import LocalJob, controller_status, wait_until
from relayrl.models.assets import prepare_assets
from relayrl.ops.args import OneLineParser, existing_dir
from relayrl.rpc.channels import open_channel
from relayrl.runtime.ports import free_port
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc

TARGET_TRAJECTORIES_PER_S = 10_000  # issue #9: the control plane on the 2-core development machine
BARE_TRAJECTORIES = 20_000  # the baseline is a rate: this many trajectories measure it (the paused controller idles)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="relayrl bench controller", description=__doc__)
    parser.add_argument("--workers", type=int, default=1000, help="simulated rollout workers")
    parser.add_argument("--trajectories", type=int, default=100_000, help="generated trajectories to measure")
    parser.add_argument("--simulators", type=int, default=4, help="processes the simulated workers are spread over")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (GRPO group size)")
    parser.add_argument("--batch-groups", type=int, default=256, help="controller.train_batch_groups")
    parser.add_argument("--gen-batch", type=int, default=512, help="controller.prompts_per_gen_batch")
    parser.add_argument("--dispatch-chunk", type=int, default=4, help="controller.dispatch_chunk")
    parser.add_argument("--max-staleness", type=int, default=1, help="controller.max_staleness")
    parser.add_argument("--response-tokens", type=int, default=16, help="tokens per canned response")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="first heartbeat period (then the controller's)")
    parser.add_argument("--generate-s", type=float, default=0.0, help="seconds a simulated Generate call takes")
    parser.add_argument("--idle-s", type=float, default=5.0, help="seconds the idle, paused controller is measured")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument("--workdir", type=existing_dir, help="where the model, data, state and logs go (default: temp)")
    parser.add_argument("--json", action="store_true", help="print the JSON object only")
    args = parser.parse_args(argv)
    for name in ("workers", "trajectories", "simulators", "n", "batch_groups", "gen_batch", "dispatch_chunk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.generate_s < 0:
        parser.error(f"--generate-s: must be >= 0, got {args.generate_s}")
    if args.response_tokens < 2:
        parser.error(f"--response-tokens: must be >= 2, got {args.response_tokens}")
    for name in ("heartbeat_s", "idle_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    return args


def bench_config(workdir: Path, args: argparse.Namespace) -> Path:
    """The run config: the tiny demo model's tokenizer, the digits task, the batch shape from ``args``."""
    raw = {
        "run": {"name": "bench-controller", "dir": str(workdir / "runs")},
        "model": {"path": "builtin:tiny-qwen2"},
        "data": {"path": "builtin:digits"},
        "rollout": {"n": args.n, "max_tokens": args.response_tokens},
        "controller": {
            "prompts_per_gen_batch": args.gen_batch,
            "train_batch_groups": args.batch_groups,
            "max_gen_batches": 64,
            "max_staleness": args.max_staleness,
            "dispatch_chunk": args.dispatch_chunk,
            "max_workers": max(1024, args.workers),
            "worker_timeout_s": max(30.0, 10 * args.heartbeat_s),
            "reward": {"fn": "prefix_match"},
        },
        "trainer": {"steps": 1_000_000},  # the simulated trainer stops; the run never finishes by itself
    }
    path = workdir / "bench-controller.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Pulled:
    """One batch as the simulated trainer got it."""

    at: float  # time.monotonic() when PullBatch returned
    trained: int  # samples in the batch
    generated: int  # trajectories generated for it (kept and dropped groups)
    groups_filtered: int
    response_len_mean: float  # tokens per generated response, as the controller counted them


def pull(stub, step: int, deadline: float) -> controller_pb2.Batch:
    """PullBatch until the batch is there (UNAVAILABLE: not yet); FAILED_PRECONDITION and the rest raise."""
    request = controller_pb2.PullBatchRequest(step=step, timeout_s=2)
    while True:
        try:
            return stub.PullBatch(request, timeout=30)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise RuntimeError(f"PullBatch(step={step}): {rpc_error_text(err)}") from None


def simulated_trainer(stub, versions: VersionFile, trajectories: int, deadline: float) -> list[Pulled]:
    """Report the starting weights published (as trainer rank 0 does), then pull, 'update' the simulated
    workers' weights, report; until ``trajectories`` were generated."""
    plan = stub.GetWeightSyncPlan(controller_pb2.GetWeightSyncPlanRequest(version=0), timeout=30)
    initial = controller_pb2.ReportWeightSyncRequest(
        policy_version=0, synced_worker_ids=[w.worker_id for w in plan.workers], reason="initial"
    )
    stub.ReportWeightSync(initial, timeout=60)
    pulled: list[Pulled] = []
    for step in itertools.count(1):
        batch = pull(stub, step, deadline)
        stats = batch.stats
        pulled.append(
            Pulled(
                time.monotonic(),
                len(batch.samples),
                stats.samples_generated,
                stats.groups_filtered,
                stats.response_len_mean,
            )
        )
        plan = stub.GetWeightSyncPlan(controller_pb2.GetWeightSyncPlanRequest(version=step), timeout=30)
        versions.write(step)
        report = controller_pb2.ReportStepRequest(
            step=step,
            batch_id=batch.batch_id,
            policy_version=step,
            synced_worker_ids=[w.worker_id for w in plan.workers],
        )
        stub.ReportStep(report, timeout=60)
        if sum(p.generated for p in pulled) >= trajectories:
            return pulled
    raise AssertionError("unreachable")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus ``histogram_quantile``: linear interpolation inside the bucket holding rank q * count.

    ``buckets``: (upper bound, cumulative count), ascending, the last one +Inf."""
    total = buckets[-1][1]
    if total == 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def generate_latency(metrics_port: int) -> dict:
    """p50/p99/mean of the controller's Generate round trips (ms) and the call count, from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "relayrl_generate_seconds":
            buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
            total = next(s.value for s in family.samples if s.name.endswith("_sum"))
            calls = buckets[-1][1]
            return {
                "generate_calls": int(calls),
                "dispatch_latency_p50_ms": round(1000 * histogram_quantile(0.50, buckets), 3),
                "dispatch_latency_p99_ms": round(1000 * histogram_quantile(0.99, buckets), 3),
                "dispatch_latency_mean_ms": round(1000 * total / max(calls, 1), 3),
            }
    raise RuntimeError("the controller's /metrics has no relayrl_generate_seconds")


def bare_dispatch(addresses: list[str], trajectories: int, args: argparse.Namespace, version: int) -> float:
    """Baseline: the same Generate calls straight to the simulated workers, only counted; trajectories/s. As many
    calls at once as one generation round of the controller dispatches (a chunk each), on channels configured as
    the controller's."""
    stubs = [rollout_pb2_grpc.RolloutServiceStub(open_channel(a, WORKER_CHANNEL_OPTIONS)) for a in addresses]
    params = common_pb2.SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.response_tokens)
    chunk = range(args.dispatch_chunk)
    prompts = [rollout_pb2.PromptInput(prompt_id=f"bare-{i}", token_ids=[3, 4, 5, 6]) for i in chunk]
    request = rollout_pb2.GenerateRequest(prompts=prompts, params=params, min_policy_version=version)
    calls = math.ceil(trajectories / (args.dispatch_chunk * args.n))
    threads = math.ceil(args.gen_batch / args.dispatch_chunk)
    counted = [0] * threads
    lock = threading.Lock()
    next_call = itertools.count()

    def run(thread: int) -> None:
        while True:
            with lock:
                call = next(next_call)
            if call >= calls:
                return
            responses = stubs[call % len(stubs)].Generate(request, timeout=args.timeout)
            counted[thread] += sum(len(r.completions) for r in responses)

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))
    return sum(counted) / (time.monotonic() - started)


def simulator_commands(args: argparse.Namespace, controller: str, model: str, version_file: Path) -> list[list[str]]:
    per_process = math.ceil(args.workers / args.simulators)
    counts = [min(per_process, args.workers - i * per_process) for i in range(args.simulators)]
    from transformers import AutoTokenizer  # seconds of imports: after the flags are checked

    responses = json.dumps(canned_responses(AutoTokenizer.from_pretrained(model), args.response_tokens))
    common = ["--controller", controller, "--responses", responses, "--version-file", str(version_file)]
    common += ["--heartbeat-s", str(args.heartbeat_s), "--generate-s", str(args.generate_s)]
    module = [sys.executable, "-m", "relayrl.bench.simulated_workers"]
    return [[*module, *common, "--index", str(i), "--count", str(c)] for i, c in enumerate(counts) if c > 0]


def run_bench(workdir: Path, args: argparse.Namespace) -> dict:
    machine = machine_record(None)  # simulated workers: no model computes
    config_path = bench_config(workdir, args)
    cfg = load_config(config_path)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a controller resumes from its state: start from none
    prepare_assets(cfg)
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    job = LocalJob(cfg, config_path, logs)
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + args.timeout
    versions = VersionFile(workdir / "policy_version")
    try:
        serve = ["--config", str(config_path), "--port", str(port), "--metrics-port", str(metrics_port)]
        job.spawn("controller", job.relay("controller", "serve", *serve))
        wait_until(lambda: controller_status(address), 180, "the controller", job, ["controller"])
        stub = controller_pb2_grpc.ControllerServiceStub(open_channel(address))
        stub.Pause(controller_pb2.PauseRunRequest(reason="bench: until every simulated worker is registered"))
        roles = []
        for i, argv in enumerate(simulator_commands(args, address, str(cfg.model.path), workdir / "policy_version")):
            roles.append(f"rollout-sim-{i}")
            job.spawn(roles[-1], argv)
        registered = f"{args.workers} simulated workers to register"
        wait_until(lambda: len(controller_status(address).workers) >= args.workers, 300, registered, job, roles)
        pid = job.children["controller"].pid
        idle_cpu = cpu_seconds(pid)
        time.sleep(args.idle_s)  # paused: what heartbeats and the Stats poll of every worker cost the controller
        idle_share = (cpu_seconds(pid) - idle_cpu) / args.idle_s
        addresses = sorted(w.address for w in controller_status(address).workers)
        bare = bare_dispatch(addresses, min(args.trajectories, BARE_TRAJECTORIES), args, versions.read())
        rss_start, cpu_start = rss_mib(pid), cpu_seconds(pid)
        started = time.monotonic()
        stub.Resume(controller_pb2.ResumeRunRequest())
        pulled = simulated_trainer(stub, versions, args.trajectories, deadline)
        seconds = pulled[-1].at - started
        cpu = cpu_seconds(pid) - cpu_start
        rss_peak = rss_mib(pid, "VmHWM")
        latency = generate_latency(metrics_port)
        status = controller_status(address)
    finally:
        job.stop(grace_s=10)
        versions.close()
    generated = sum(p.generated for p in pulled)
    trained = sum(p.trained for p in pulled)
    rate = generated / seconds
    return {
        "workers": args.workers,
        "registered_workers": len(status.workers),
        "simulator_processes": args.simulators,
        "n": args.n,
        "train_batch_groups": args.batch_groups,
        "prompts_per_gen_batch": args.gen_batch,
        "dispatch_chunk": args.dispatch_chunk,
        "max_staleness": args.max_staleness,
        "response_tokens": args.response_tokens,
        "heartbeat_s": args.heartbeat_s,
        "controller_heartbeats_per_s": ControllerConfig().heartbeats_per_s,
        "generate_s": args.generate_s,
        "steps": len(pulled),
        "seconds": round(seconds, 3),
        "trajectories": generated,
        "trajectories_trained": trained,
        "groups_filtered": sum(p.groups_filtered for p in pulled),
        "response_tokens_mean": round(sum(p.response_len_mean * p.generated for p in pulled) / generated, 2),
        "trajectories_per_second": round(rate, 1),
        "trained_trajectories_per_second": round(trained / seconds, 1),
        **latency,
        "controller_rss_mib_start": None if rss_start is None else round(rss_start, 1),
        "controller_rss_mib_peak": None if rss_peak is None else round(rss_peak, 1),
        "controller_cpu_seconds": round(cpu, 3),
        "controller_cpu_us_per_trajectory": round(1e6 * cpu / generated, 2),
        "controller_idle_cpu_share": round(idle_share, 3),
        # the run's CPU less what the idle fleet alone costs over as long: the marginal cost of a trajectory
        "controller_cpu_us_per_trajectory_net": round(1e6 * max(0.0, cpu - idle_share * seconds) / generated, 2),
        "ledger": {state: getattr(status.ledger, state) for state in ("trained", "filtered", "failed", "pending")},
        "bare_trajectories_per_second": round(bare, 1),
        "controller_vs_bare": round(rate / bare, 3),
        "target_trajectories_per_second": TARGET_TRAJECTORIES_PER_S,
        "vs_target": round(rate / TARGET_TRAJECTORIES_PER_S, 3),
        "machine": machine | {"loadavg_at_end": list(os.getloadavg())},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-controller-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.json:
            print(f"controller + {args.workers} simulated workers (logs in {workdir / 'logs'})", file=sys.stderr)
        result = run_bench(workdir, args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:34} {value}")
    return 0
