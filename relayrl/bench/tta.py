"""``relayrl bench tta``: wall seconds and samples to a held-out accuracy target, relayrl against TRL's
``GRPOTrainer`` on the real model (issue 49, item 4).

The workload is ``--config``'s, by default ``relayrl bench e2e``'s real one (examples/addition-smollm2.yaml:
SmolLM2-135M-Instruct, single-digit sums, ``last_number`` reward; examples/reasoning-smollm2.yaml is the
reasoning-length one), at ``--prompts`` prompts x ``--n`` samples a step, with its held-out set ``heldout`` scored
greedily every ``--every`` steps. Both systems are scored by the same code: relayrl's
controller evaluator, in relayrl's run (``eval.every``) and, for TRL, through ``relayrl eval CONFIG --checkpoint``
on the checkpoint TRL saves every ``--every`` rounds, scored while TRL waits (relayrl/bench/trl_runner.py). A run
stops at the first eval whose ``--metric`` reaches ``--target``, or at ``--max-steps``.

Time to target = the wall seconds from the system's launch to the end of the step whose weights first score
``>= target`` (``first_at_target``); samples to target = the samples generated up to that step. Neither system
scores its starting weights (TRL scores only the checkpoints it saves, so relayrl runs with ``eval.before_train``
off). TRL's clock is net of the seconds it waited for its checkpoints to be saved and scored; relayrl's includes
its in-run evals (they share the cores with training), so the comparison errs against relayrl. samples/s: the
steady steps' (after ``--warmup``), on the same clocks (``relayrl.bench.e2e.summarize``).

One invocation runs one system at one seed (``--system``, ``--seed``), so each run can hold the shared bench lock
alone; its row is merged into ``--out`` (created, or updated when its settings match) and the medians over seeds per
system and the ratios TRL / relayrl are recomputed from every row there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from relayrl.bench.e2e import REAL_CONFIG, TRL_MODES, UNMEASURED, Run, summarize, trl_spec
from relayrl.bench.example_run import scratch
from relayrl.bench.record import machine_record, run_sides, trl_side
from relayrl.config import RelayConfig, load_config
from relayrl.models.assets import prepare_assets
from relayrl.ops.args import OneLineParser
from relayrl.runtime.procs import kill_tree
from relayrl.trainer.metrics import read_evals, read_metrics

EVAL_SET = "heldout"  # the example config's held-out set
RELAYRL_VARIANTS = {  # relayrl system -> its overrides over the example config
    "relayrl-default": [],
    "relayrl-k1": ["controller.max_staleness=1"],
    "relayrl-recompute": ["algorithm.old_logprobs=recompute"],
}
SYSTEMS = (*RELAYRL_VARIANTS, *TRL_MODES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="relayrl bench tta", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True, choices=SYSTEMS, help="the system this invocation runs")
    p.add_argument("--config", type=Path, default=REAL_CONFIG, help="the relayrl config both systems run")
    p.add_argument("--seed", type=int, default=0, help="run.seed of both systems (prompt order, sampling)")
    p.add_argument("--out", required=True, help="the JSON file the run's row is merged into")
    p.add_argument("--prompts", type=int, default=8, help="prompts a step")
    p.add_argument("--n", type=int, default=8, help="samples a prompt")
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy to reach")
    p.add_argument("--metric", default="mean@1", help="the eval metric the target is on")
    p.add_argument("--every", type=int, default=2, help="steps between evals (TRL: between checkpoints)")
    p.add_argument("--max-steps", type=int, default=16, help="the step cap of a run that misses the target")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of samples/s")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override, both systems")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="limit per run")
    args = p.parse_args(argv)
    if args.every < 1 or args.max_steps < args.every or args.warmup < 0:
        p.error("--every must be >= 1, --max-steps >= --every and --warmup >= 0")
    if not 0 < args.target <= 1:
        p.error(f"--target: a held-out accuracy in (0, 1], got {args.target}")
    return args


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it (what a result file records), else as given."""
    resolved = path.resolve()
    root = REAL_CONFIG.parents[1]
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


def settings(args: argparse.Namespace) -> dict:
    """What every row merged into one file must share (a mismatch is refused)."""
    return {
        "config": repo_path(args.config),
        "prompts_per_step": args.prompts,
        "n": args.n,
        "target": args.target,
        "metric": args.metric,
        "eval_set": EVAL_SET,
        "every": args.every,
        "max_steps": args.max_steps,
        "warmup": args.warmup,
        "extra_overrides": args.set,
        "scores_starting_weights": False,  # eval.before_train off: TRL scores only the checkpoints it saves
    }


def overrides(args: argparse.Namespace) -> list[str]:
    """The example config's overrides both systems run: batch shape, seed, step cap, eval cadence."""
    return [
        *UNMEASURED[1:],  # the sample logs off; the eval section stays: it is what is measured
        f"controller.prompts_per_gen_batch={args.prompts}", f"controller.train_batch_groups={args.prompts}",
        f"rollout.n={args.n}", f"run.seed={args.seed}", f"trainer.steps={args.max_steps}",
        "trainer.checkpoint_every=0", f"eval.every={args.every}", "eval.before_train=false", *args.set,
    ]  # fmt: skip


def first_at_target(
    evals: list[dict], records: list[dict], launched: float, target: float, metric: str = "mean@1"
) -> dict:
    """The first evaluated version v (in version order) whose ``metric`` is >= ``target``: ``wall_s`` = the net time
    at the end of step v (``time - paused_seconds``, the latter 0 where absent) - ``launched`` (0 for v = 0),
    ``samples`` = the samples generated in steps 1..v; ``reached`` False (and those None) when no eval reaches it.
    ``curve``: every eval as [version, value, wall_s of its step or None]."""
    ends = {r["step"]: r["time"] - r.get("paused_seconds", 0.0) - launched for r in records}
    ends[0] = 0.0
    curve = [[e["step"], e[metric], ends.get(e["step"])] for e in sorted(evals, key=lambda e: e["step"])]
    for version, value, wall_s in curve:
        if value >= target and wall_s is not None:
            samples = sum(r["samples_generated"] for r in records if r["step"] <= version)
            return {"reached": True, "version": version, "value": value, "wall_s": wall_s, "samples": samples,
                    "curve": curve}  # fmt: skip
    return {"reached": False, "version": None, "value": None, "wall_s": None, "samples": None, "curve": curve}


def reached(metrics: Path, target: float, metric: str) -> bool:
    """Whether an eval line of ``metrics`` has ``metric >= target`` (a partly written file reads as what is whole)."""
    return any(r["eval"] == EVAL_SET and r.get(metric, -1.0) >= target for r in read_evals(metrics))


def launch_until(argv: list[str], log: Path, env: dict, metrics: Path, args: argparse.Namespace) -> tuple:
    """Run ``argv`` until it exits, an eval in ``metrics`` reaches the target (its process tree is then killed) or
    ``--timeout-s``; returns (launched epoch seconds, returncode, how it ended). A run stopped at the target or at
    ``--timeout-s`` returns 0: both are the bench's caps (``ended`` says which), and the steps before them count
    (one stopped at the timeout is a lower bound on its time to target)."""
    launched = time.time()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    while proc.poll() is None:
        if reached(metrics, args.target, args.metric) or time.time() - launched > args.timeout_s:
            ended = "target" if reached(metrics, args.target, args.metric) else "timeout"
            kill_tree(proc.pid)
            proc.wait()
            return launched, 0, ended
        time.sleep(1.0)
    return launched, proc.returncode, "exit"


def run_system(args: argparse.Namespace, cfg: RelayConfig, sets: list[str], workdir: Path) -> dict:
    """One run of ``args.system``: its row (figures, time to target, the machine around it)."""
    name = f"{args.system}-s{args.seed}"
    run_dir, log = workdir / "runs" / name, workdir / f"{name}.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    machine = machine_record(None)
    runs = ["--set", f"run.dir={workdir / 'runs'}"]  # relayrl's run and the generated sets of TRL's scoring
    if args.system in RELAYRL_VARIANTS:
        argv = [sys.executable, "-m", "relayrl.cli", "up", str(args.config), *runs]
        for item in [*sets, *RELAYRL_VARIANTS[args.system], f"run.name={name}"]:
            argv += ["--set", item]
        launched, code, ended = launch_until(argv, log, {}, metrics, args)
        machine["resolved"] = run_sides(run_dir / "logs")
    else:
        continuous_batching, bf16 = TRL_MODES[args.system]
        spec = trl_spec(cfg, args.max_steps, args.trl_threads, run_dir, continuous_batching=continuous_batching,
                        bf16=bf16)  # fmt: skip
        score = [sys.executable, "-m", "relayrl.cli", "eval", str(args.config), *runs]
        spec["score"] = {"every": args.every, "target": args.target, "metric": args.metric, "set": EVAL_SET,
                         "argv": score + [arg for item in sets for arg in ("--set", item)]}  # fmt: skip
        (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        argv = [sys.executable, "-m", "relayrl.bench.trl_runner", str(run_dir / "spec.json")]
        env = {"OMP_NUM_THREADS": str(args.trl_threads), "TOKENIZERS_PARALLELISM": "false"}
        launched, code, ended = launch_until(argv, log, env, metrics, args)
        machine["resolved"] = {"trl": trl_side(log)}
    machine["loadavg_at_end"] = list(os.getloadavg())
    records, evals = read_metrics(metrics), read_evals(metrics)
    net = [{**r, "time": r["time"] - r.get("paused_seconds", 0.0)} for r in records]
    run = Run("tta", args.system, args.seed, launched, time.time() - launched, code, net, log)
    row = summarize(run, argparse.Namespace(warmup=args.warmup, target=1.0, target_window=1), 0, False)
    keep = ("system", "steps", "returncode", "wall_s", "s_per_step", "samples_per_s", "tokens_per_s", "generation_s",
            "train_s", "response_len_mean", "reward_curve", "logprob_mismatch", "error")  # fmt: skip
    return {
        **{k: row[k] for k in keep if k in row},
        "seed": args.seed,
        "ended": ended,
        "paused_s": records[-1].get("paused_seconds", 0.0) if records else 0.0,
        "to_target": first_at_target(evals, records, launched, args.target, args.metric),
        "machine": machine,
    }


def aggregate(rows: list[dict]) -> dict:
    """Per system the medians over its seeds (wall seconds and samples to target over the seeds that reached it,
    samples/s over all), and per relayrl system each TRL system's median over its own (> 1: relayrl faster)."""
    systems = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system and "error" not in r]
        hit = [r["to_target"] for r in mine if r["to_target"]["reached"]]
        systems[system] = {
            "seeds": sorted(r["seed"] for r in mine),
            "seeds_reached": len(hit),
            "wall_s_to_target": statistics.median(t["wall_s"] for t in hit) if hit else None,
            "samples_to_target": statistics.median(t["samples"] for t in hit) if hit else None,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in mine) if mine else None,
        }
    ratios = {}
    for mine, entry in systems.items():
        for trl in (name for name in systems if name in TRL_MODES):
            if mine in TRL_MODES:
                continue
            other = systems[trl]
            ratios[f"{trl}/{mine}"] = {
                key: other[key] / entry[key] if other[key] is not None and entry[key] else None
                for key in ("wall_s_to_target", "samples_to_target")
            } | {"samples_per_s": entry["samples_per_s"] / other["samples_per_s"] if other["samples_per_s"] else None}
    return {"systems": systems, "trl_over_relayrl": ratios}


def merge(path: Path, shared: dict, row: dict, command: list[str]) -> dict:
    """``path``'s result with ``row`` in place of the same system and seed's (its settings must be ``shared``)."""
    result = json.loads(path.read_text()) if path.is_file() else {"bench": "tta", "settings": shared, "runs": []}
    if result["settings"] != shared:
        differ = sorted(k for k in shared if result["settings"].get(k) != shared[k])
        raise SystemExit(f"relayrl bench tta: --out: {path} was measured with other settings ({differ})")
    runs = [r for r in result["runs"] if (r["system"], r["seed"]) != (row["system"], row["seed"])]
    runs.append({**row, "command": command})
    return result | {"runs": runs, **aggregate(runs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sets = overrides(args)
    with scratch("relayrl-bench-tta-") as workdir:  # kept (and named) when the run fails
        cfg = load_config(args.config, [*sets, f"run.dir={workdir / 'assets'}"])
        prepare_assets(cfg)  # the built model, before any clock starts; both systems name its directory
        sets.append(f"model.path={cfg.model.path}")  # data as written: a generated set is a function of its config
        row = run_system(args, cfg, sets, workdir)
        command = ["relayrl", "bench", "tta", *(sys.argv[1:] if argv is None else argv)]
        result = merge(Path(args.out), settings(args), row, command)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: row[k] for k in ("system", "seed", "ended", "samples_per_s", "to_target") if k in row}))
        if "error" in row or row["to_target"]["curve"] == []:
            raise SystemExit(f"relayrl bench tta: {args.system} seed {args.seed}: {row.get('error', 'no eval')}")
    return 0
