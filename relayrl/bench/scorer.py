"""``relayrl bench scorer``: what serving a reward model costs and gives (issue 46 item 8).

1. **Throughput.** SmolLM2-135M-Instruct as a one-label sequence classifier (``reward_model_from_causal_lm``: its
   backbone, a fresh score head under seed 0; ``--model`` serves an existing export instead) scores conversations
   made of SmolLM2's own samples (``PAIRS``: each preference row gives prompt + chosen and prompt + rejected).
   Requests are groups of ``--request-pairs`` pairs (the controller sends one group a call). Three ways, the same
   requests, each after one untimed warm-up, every scoring process on ``--threads`` torch threads (so a second
   worker is a second share of the machine, as it is on a node with cores to spare):

   - **in-process, one request at a time**: the scorer's own model class (``relayrl.scorer.models.Classifier``)
     in this process, one model call per request;
   - **served, 1 worker**: ``relayrl reward serve`` (a process of its own, real gRPC, dynamic batching), called by
     ``--callers`` concurrent clients (``ScorerClient``, as the controller calls it);
   - **served, 2 workers**: two such processes, the clients turning between them.

   Each gives pairs/s = pairs / wall seconds from the first request sent to the last answered; the served ones
   also items per model call (the servers' Describe counters over the timed requests), and the largest difference
   between a served score and the in-process score of the same pair.
2. **The RL step.** ``relayrl up examples/addition-smollm2.yaml`` for ``--steps`` steps (no eval), with its reward
   function (``last_number``) and with that reward model served under ``up`` as its only reward
   (``controller.reward.fns: {scorer:rm: 1.0}``, one replica), alternating for ``--rounds`` rounds: each system's
   median ``step_seconds`` and ``generation_seconds`` over its runs' steps after the first (a median: one step
   slowed by a neighbour on a shared machine does not move it), and the served runs' median
   ``scorer/rm/latency_s`` and items per model call; the difference of the step medians is what scoring adds to a
   step when it is pipelined with generation.

Writes JSON with the machine record (``relayrl/bench/record.py``), the ratios, and the command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import yaml

from relayrl.bench.addition import CONFIG as ADDITION
from relayrl.bench.example_run import ROOT, read_lines, run_example, write_result
from relayrl.bench.record import machine_record, model_side
from relayrl.config import ScorerConfig, load_config

PAIRS = ROOT / "bench" / "results" / "preference-smollm2-pairs.jsonl"  # SmolLM2's own samples (bench preference)
SCORER = "rm"
COMMAND = "relayrl bench scorer --out bench/results/scorer.json"
LATENCY_KEY = f"scorer/{SCORER}/latency_s"  # the controller's mean seconds of a Score call in the step
BATCH_KEY = f"scorer/{SCORER}/batch_size"  # the servers' items per model call, as the step read them


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench scorer", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an existing reward-model export (default: SmolLM2 with a fresh head)")
    p.add_argument("--pairs", type=int, default=128, help="pairs scored by each way, per request size")
    p.add_argument("--request-pairs", type=int, nargs="+", default=[1, 8], help="pairs per request (each measured)")
    p.add_argument("--callers", type=int, default=8, help="concurrent clients of the served scorers")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each scoring process")
    p.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=6, help="RL steps of each relayrl up run (0: no RL runs)")
    p.add_argument("--rounds", type=int, default=2, help="relayrl up runs of each system, alternating")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    return p.parse_args(argv)


def conversations(path: Path, count: int) -> list[list[dict]]:
    """``count`` conversations (prompt + chosen, prompt + rejected of each preference row at ``path``, cycled)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    each = [row["prompt"] + row[side] for row in rows for side in ("chosen", "rejected")]
    return list(itertools.islice(itertools.cycle(each), count))


def requests_of(items: list, size: int) -> list[list]:
    """``items`` in consecutive requests of ``size`` (the last one shorter when it does not divide)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_reward_model(directory: Path) -> Path:
    """SmolLM2-135M-Instruct (the addition example's builtin, built once per machine) as a one-label classifier with
    a fresh head under seed 0, exported to ``directory``."""
    from relayrl.models.assets import prepare_model
    from relayrl.rewards.reward_model import reward_model_from_causal_lm, save_reward_model

    cfg = load_config(ADDITION)
    prepare_model(cfg)
    model, tokenizer = reward_model_from_causal_lm(cfg.model.path, seed=0)
    return save_reward_model(model, tokenizer, directory)


def load_in_process(scorer: ScorerConfig, threads: int):
    """The scorer's own model class (``relayrl.scorer.models.Classifier``) in this process, on ``threads`` threads."""
    import torch

    from relayrl.scorer.models import Classifier

    torch.set_num_threads(threads)
    return Classifier(scorer, SCORER)


def in_process(model, requests: Sequence[list[list[dict]]]) -> tuple[dict, list[float]]:
    """``requests`` scored by ``model`` (``load_in_process``) one at a time, one model call each: (figures, scores
    in order)."""
    import torch

    from relayrl.scorer.models import Pair

    def score(request: list[list[dict]]) -> list[float]:
        return model.run([model.check(i, Pair(messages=c)) for i, c in enumerate(request)])

    score(requests[0])  # warm-up
    start = time.monotonic()
    scores = [s for request in requests for s in score(request)]
    wall = time.monotonic() - start
    return {"pairs_per_s": len(scores) / wall, "wall_s": wall, "threads": torch.get_num_threads()}, scores


def served(
    scorer: ScorerConfig, addresses: list[str], requests: Sequence[list[list[dict]]], callers: int
) -> tuple[dict, list[float]]:
    """``requests`` sent by ``callers`` concurrent clients to the servers at ``addresses`` (each call on the next
    server): (figures, scores in order). Items per model call from the servers' Describe counters over the timed
    requests."""
    from relayrl.rewards.served import ScorerClient

    client = ScorerClient(SCORER, scorer.model_copy(update={"servers": addresses, "timeout_s": 600.0}))
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(client.score, requests[: callers * len(addresses)]))  # warm-up: every server, every caller
        before = counters(client)
        start = time.monotonic()
        scores = [s for answer in pool.map(client.score, requests) for s in answer]
        wall = time.monotonic() - start
    items, batches = (after - first for after, first in zip(counters(client), before))
    figures = {
        "pairs_per_s": len(scores) / wall,
        "wall_s": wall,
        "workers": len(addresses),
        "callers": callers,
        "mean_batch_size": items / batches if batches else 0.0,
    }
    return figures, scores


def counters(client) -> tuple[int, int]:
    """(items scored, model calls) summed over the client's servers (Describe)."""
    answers = [answer for _, answer in client.describe_servers(timeout_s=30.0)]
    if any(isinstance(answer, str) for answer in answers):
        raise SystemExit(f"a scorer did not answer Describe: {answers}")
    return sum(a.items_scored for a in answers), sum(a.batches for a in answers)


@contextmanager
def scorer_servers(model: str, precision: str, workers: int, threads: int, workdir: Path) -> Iterator[list[str]]:
    """``workers`` x ``relayrl reward serve`` of ``model`` (processes started as ``relayrl up`` starts scorers),
    each on ``threads`` torch threads; yields their addresses once every one answers its health check."""
    from relayrl.launcher import LocalJob, wait_until
    from relayrl.ops.scorers import scorers_serving, start_scorers

    raw = {
        "model": {"path": model},
        "data": {"path": str(PAIRS)},
        "rollout": {"threads": threads},
        "scorers": {SCORER: {"kind": "classifier", "model": model, "replicas": workers, "precision": precision}},
    }
    config = workdir / f"scorers-{workers}.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    job = LocalJob(load_config(config), config, workdir / f"logs-{workers}")
    job.logs.mkdir(parents=True, exist_ok=True)
    try:
        roles = start_scorers(job)
        wait_until(lambda: scorers_serving(job.cfg), 600, f"{workers} scorers", job, roles)
        yield job.cfg.scorers[SCORER].servers
    finally:
        job.stop(grace_s=10)


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def throughput(model: str, args: argparse.Namespace, workdir: Path) -> tuple[list[dict], dict]:
    """Per request size: the three ways' figures and their ratios; and the in-process side's precision."""
    scorer = ScorerConfig(kind="classifier", model=model, precision=args.precision)
    items = conversations(PAIRS, args.pairs)
    sizes = {size: requests_of(items, size) for size in args.request_pairs}
    rows = {size: {"request_pairs": size} for size in sizes}
    local = load_in_process(scorer, args.threads)
    side = model_side(local.model, local.dtype)
    for size, requests in sizes.items():
        rows[size]["in_process"], rows[size]["reference_scores"] = in_process(local, requests)
    del local
    for workers in (1, 2):
        with scorer_servers(model, args.precision, workers, args.threads, workdir) as addresses:
            for size, requests in sizes.items():
                figures, scores = served(scorer, addresses, requests, args.callers)
                figures["max_abs_diff_vs_in_process"] = max_abs_diff(scores, rows[size]["reference_scores"])
                rows[size][f"served_{workers}"] = figures
    for row in rows.values():
        del row["reference_scores"]
        row |= ratios(row)
    return list(rows.values()), side


def ratios(row: dict) -> dict:
    """pairs/s of served 1 worker over in-process, and of 2 workers over 1."""
    rate = {way: row[way]["pairs_per_s"] for way in ("in_process", "served_1", "served_2")}
    return {
        "served_1_vs_in_process": rate["served_1"] / rate["in_process"],
        "served_2_vs_served_1": rate["served_2"] / rate["served_1"],
    }


def step_figures(runs: list[list[dict]], walls: list[float]) -> dict:
    """One system's runs (each its metrics.jsonl step records): wall seconds and every step's seconds of each run,
    and the medians over every run's steps after the first (step 1 also pays every first call's setup) of the
    step and generation seconds, and of the scorer's call latency and items per model call where it logged them."""
    later = [r for records in runs for r in records[1:] or records]
    out = {
        "runs": [
            {"wall_s": wall, "step_seconds": [r["step_seconds"] for r in records]} for records, wall in zip(runs, walls)
        ],
        "steps_measured": len(later),
        "step_seconds_median": statistics.median(r["step_seconds"] for r in later),
        "generation_seconds_median": statistics.median(r["generation_seconds"] for r in later),
    }
    for key, name in ((LATENCY_KEY, "scorer_latency_s_median"), (BATCH_KEY, "scorer_batch_size_median")):
        if any(key in r for r in later):
            out[name] = statistics.median(r.get(key, 0.0) for r in later)
    return out


def rl_step(model: str, args: argparse.Namespace) -> dict:
    """The addition example with its reward function and with the reward model served as its only reward, runs of
    the two alternating for ``args.rounds`` rounds."""
    common = [f"trainer.steps={args.steps}", "eval=null"]
    served_rm = [
        f"scorers.{SCORER}.kind=classifier",
        f"scorers.{SCORER}.model={model}",
        f"scorers.{SCORER}.precision={args.precision}",
        f'controller.reward.fns={{"scorer:{SCORER}": 1.0}}',
    ]
    systems = {"function_reward": common, "served_reward_model": common + served_rm}
    runs: dict[str, list] = {name: [] for name in systems}
    machines = []
    for _ in range(args.rounds):
        for name, overrides in systems.items():
            run = run_example(str(ADDITION), overrides, args.timeout_s)
            runs[name].append((read_lines(run.run_dir / "metrics.jsonl")[0], run.wall_s))
            machines.append({"system": name, **run.machine})
            shutil.rmtree(run.workdir, ignore_errors=True)
    out = {"config": os.path.relpath(ADDITION, ROOT), "overrides": common, "served_overrides": served_rm}
    for name, done in runs.items():
        out[name] = step_figures([records for records, _ in done], [wall for _, wall in done])
    function, rm = out["function_reward"]["step_seconds_median"], out["served_reward_model"]["step_seconds_median"]
    out["added_s_per_step"] = rm - function
    out["step_ratio_served_vs_function"] = rm / function
    out["machines"] = machines
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_record(None)
    workdir = Path(tempfile.mkdtemp(prefix="relayrl-bench-scorer-"))
    try:
        model = args.model or str(build_reward_model(workdir / "rm"))
        rows, side = throughput(model, args, workdir)
        result = {
            "bench": "scorer",
            "command": COMMAND,
            "argv": argv if argv is not None else [],
            "machine": machine | {"resolved": {"scorer": side}, "loadavg_after_throughput": list(os.getloadavg())},
            "model": args.model or "SmolLM2-135M-Instruct as a one-label classifier (fresh head, seed 0)",
            "pairs_source": os.path.relpath(PAIRS, ROOT),
            "pairs": args.pairs,
            "threads_per_process": args.threads,
            "throughput": rows,
        }
        if args.steps:
            result["rl_step"] = rl_step(model, args)
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
        write_result(result, args.out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
