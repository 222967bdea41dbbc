"""``relayrl bench heldout``: a run as a user starts it (``relayrl up CONFIG``, default the demo), its held-out
accuracy before and after training from the run's own evals.

Runs the config in a fresh run directory and writes JSON: the command, the machine's load, the wall seconds, every
eval of every set by the version it measured (metrics.jsonl's eval lines), each set's figures at the first and the
last version, and the training reward of the first and last 10 steps. ``--png`` copies the run's PNG (the training
reward with the held-out curves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relayrl.bench.record import machine_record, run_sides
from relayrl.trainer.metrics import read_evals, read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "digits.yaml"
COMMAND = "relayrl bench heldout --out bench/results/heldout-digits.json --png docs/heldout-digits.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench heldout", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the run's config (it needs an eval section)")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value config overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="copy the run's reward PNG here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def summarize(records: list[dict], evals: list[dict]) -> dict:
    """Each set's evals by version, its first and last, and the training reward's first and last 10 steps."""
    sets: dict[str, list[dict]] = {}
    for e in sorted(evals, key=lambda e: e["step"]):
        sets.setdefault(e["eval"], []).append(e)
    rewards = [r["reward_mean"] for r in records]
    return {
        "steps": len(records),
        "train_reward_first10": statistics.fmean(rewards[:10]),
        "train_reward_last10": statistics.fmean(rewards[-10:]),
        "heldout": {
            name: {
                "before": {"version": runs[0]["step"], **_metrics(runs[0])},
                "after": {"version": runs[-1]["step"], **_metrics(runs[-1])},
                "by_version": [{"version": e["step"], **_metrics(e)} for e in runs],
            }
            for name, runs in sets.items()
        },
    }


def _metrics(record: dict) -> dict:
    return {k: v for k, v in record.items() if "@" in k or "^" in k or k in ("response_len_mean", "truncated_frac")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="relayrl-bench-heldout-"))
    argv_up = [sys.executable, "-m", "relayrl.cli", "up", args.config, "--set", f"run.dir={workdir / 'runs'}"]
    for override in args.overrides:
        argv_up += ["--set", override]
    machine = machine_record(None)
    start = time.monotonic()
    done = subprocess.run(argv_up, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    wall_s = time.monotonic() - start
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    (run_dir,) = [p for p in (workdir / "runs").iterdir() if p.is_dir()]
    metrics = run_dir / "metrics.jsonl"
    result = {
        "bench": "heldout",
        "command": COMMAND,
        "config": os.path.relpath(args.config, ROOT),
        "overrides": args.overrides,
        "machine": machine | {"resolved": run_sides(run_dir / "logs"), "loadavg_at_end": list(os.getloadavg())},
        "wall_s": wall_s,
        **summarize(read_metrics(metrics), read_evals(metrics)),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.png:
        shutil.copyfile(run_dir / "reward.png", args.png)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
