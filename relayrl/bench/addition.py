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

from relayrl.bench.example_run import ROOT, publish, read_lines, reward_gain, run_example

CONFIG = ROOT / "examples" / "addition-smollm2.yaml"
COMMAND = "relayrl bench addition --out bench/results/addition-smollm2.json --png docs/addition-smollm2.png"
HELDOUT = "heldout"  # the example's eval set
STEP_KEYS = ("step", "reward_mean", "response_len_mean", "step_seconds", "generation_seconds", "logprob_mismatch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench addition", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the example's config")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value config overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="copy the run's reward.png here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def heldout_accuracy(evals: list[dict], metric: str = "mean@1") -> dict:
    """Greedy accuracy (``metric``, else pass@1) on the held-out set at its first eval (before training) and its
    last (after)."""
    points = sorted((r for r in evals if r["eval"] == HELDOUT), key=lambda r: r["step"])
    curve = [{"policy_version": r["step"], "accuracy": r.get(metric, r.get("pass@1"))} for r in points]
    if not curve:
        return {"heldout_before": None, "heldout_after": None, "heldout_curve": []}
    return {"heldout_before": curve[0], "heldout_after": curve[-1], "heldout_curve": curve}


def summarize(records: list[dict], evals: list[dict], wall_s: float) -> dict:
    return {
        "steps": len(records),
        "wall_s": wall_s,
        "train_wall_s": records[-1]["time"] - records[0]["time"] + records[0]["step_seconds"],
        **reward_gain(records),
        **heldout_accuracy(evals),
        "per_step": [{k: r.get(k) for k in STEP_KEYS} for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = run_example(args.config, args.overrides, args.timeout_s)
    records, evals = read_lines(run.run_dir / "metrics.jsonl")
    result = {
        "bench": "addition",
        "command": COMMAND,
        "config": os.path.relpath(args.config, ROOT),
        "overrides": args.overrides,
        "machine": run.machine,
        **summarize(records, evals, run.wall_s),
    }
    return publish(result, run, args.out, args.png)
