"""``relayrl bench addition``: the real-model example as a user runs it, ``relayrl up examples/addition-smollm2.yaml``
(SmolLM2-135M-Instruct learns single-digit sums), measured.

Writes JSON: the command, the machine's load, wall seconds of the whole run and of training alone, the first-10 and
last-10 mean reward and their difference, the held-out set's greedy accuracy (the run's own eval: ``mean@1`` of
``eval.sets.heldout``) at the first eval (policy version 0, before training) and the last (after), every eval, and
every step's reward, response length, seconds and ``logprob_mismatch``. ``--png`` copies the run's reward.png
(reward per step and the held-out curve).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from relayrl.bench.example_run import ROOT, publish, read_lines, reward_gain, run_example

CONFIG = ROOT / "examples" / "addition-smollm2.yaml"
COMMAND = "relayrl bench addition --out bench/results/addition-smollm2.json --png docs/addition-smollm2.png"
HELDOUT = "heldout"  # the example's eval set
STEP_KEYS = ("step", "reward_mean", "response_len_mean", "step_seconds", "generation_seconds", "logprob_mismatch")


def parse_args(argv: list[str] | None, bench: str = "addition", config: Path = CONFIG) -> argparse.Namespace:
    what = f"relayrl up {os.path.relpath(config, ROOT)} as a user runs it, measured (reward, held-out accuracy)"
    p = argparse.ArgumentParser(prog=f"relayrl bench {bench}", description=what)
    p.add_argument("--config", default=str(config), help="the example's config")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value config overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="copy the run's reward.png here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def heldout_accuracy(evals: list[dict], metric: str = "mean@1") -> dict:
    """Greedy accuracy (``metric``, else pass@1) on the held-out set at its first eval (before training) and its
    last (after), each with the number of prompts it scored where the record has it."""
    points = sorted((r for r in evals if r["eval"] == HELDOUT), key=lambda r: r["step"])
    curve = [
        {"policy_version": r["step"], "accuracy": r.get(metric, r.get("pass@1"))}
        | ({"prompts": r["prompts"]} if "prompts" in r else {})
        for r in points
    ]
    if not curve:
        return {"heldout_before": None, "heldout_after": None, "heldout_curve": []}
    return {"heldout_before": curve[0], "heldout_after": curve[-1], "heldout_curve": curve}


def summarize(records: list[dict], evals: list[dict], wall_s: float, metric: str = "mean@1") -> dict:
    return {
        "steps": len(records),
        "wall_s": wall_s,
        "train_wall_s": records[-1]["time"] - records[0]["time"] + records[0]["step_seconds"],
        **reward_gain(records),
        "heldout_metric": metric,
        **heldout_accuracy(evals, metric),
        "per_step": [{k: r.get(k) for k in STEP_KEYS} for r in records],
    }


def main(
    argv: list[str] | None = None,
    bench: str = "addition",
    config: Path = CONFIG,
    command: str = COMMAND,
    metric: str = "mean@1",
) -> int:
    """Run ``config`` (an example with an eval set named ``heldout``) and publish its figures as ``bench``, whose
    reproducing command is ``command``, the held-out accuracy being the eval's ``metric`` (mean@1: the mean reward
    of the greedy response, the accuracy of a 0/1 reward; pass@1: the share at full marks, for a reward with partial
    credit): ``relayrl bench addition``, and any example measured the same way."""
    args = parse_args(argv, bench, config)
    run = run_example(args.config, args.overrides, args.timeout_s)
    records, evals = read_lines(run.run_dir / "metrics.jsonl")
    result = {
        "bench": bench,
        "command": command,
        "config": os.path.relpath(args.config, ROOT),
        "overrides": args.overrides,
        "machine": run.machine,
        **summarize(records, evals, run.wall_s, metric),
    }
    return publish(result, run, args.out, args.png)
