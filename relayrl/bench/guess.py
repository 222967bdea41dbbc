"""``relayrl bench guess``: the agentic example as a user runs it, ``relayrl up examples/guess.yaml``, measured.

Runs the example in a fresh run directory (its built-in model from the asset cache) and writes JSON: the command,
the machine's load, wall seconds of the whole run and of training alone, the first-10 and last-10 mean reward and
their difference, the median over steps of the per-step median policy turns per episode, how the episodes ended,
and every step's reward, turns and seconds. ``--png`` copies the run's reward curve (reward.png).
"""

from __future__ import annotations

import argparse
import os
import statistics

from relayrl.bench.example_run import ROOT, publish, read_lines, reward_gain, run_example

CONFIG = ROOT / "examples" / "guess.yaml"
COMMAND = "relayrl bench guess --out bench/results/guess.json --png docs/guess-reward.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench guess", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the example's config")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value config overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="copy the run's reward curve here")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    return p.parse_args(argv)


def summarize(records: list[dict], wall_s: float) -> dict:
    """The figures the example promises (docs/agentic.md): reward gain and turns per episode."""
    ends: dict[str, int] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("episode_end/"):
                ends[key.removeprefix("episode_end/")] = ends.get(key.removeprefix("episode_end/"), 0) + value
    return {
        "steps": len(records),
        "wall_s": wall_s,
        "train_wall_s": records[-1]["time"] - records[0]["time"] + records[0]["step_seconds"],
        **reward_gain(records),
        "turns_median": statistics.median(r["turns_median"] for r in records),
        "turns_mean": statistics.fmean(r["turns_mean"] for r in records),
        "episodes": sum(r["episodes"] for r in records),
        "episode_ends": ends,
        "tool_parse_errors": sum(r["tool_parse_errors"] for r in records),
        "per_step": [
            {k: r[k] for k in ("step", "reward_mean", "turns_mean", "turns_median", "step_seconds", "env_seconds_mean")}
            for r in records
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = run_example(args.config, args.overrides, args.timeout_s)
    result = {
        "bench": "guess",
        "command": COMMAND,
        "config": os.path.relpath(args.config, ROOT),
        "overrides": args.overrides,
        "machine": run.machine,
        **summarize(read_lines(run.run_dir / "metrics.jsonl")[0], run.wall_s),
    }
    return publish(result, run, args.out, args.png)
