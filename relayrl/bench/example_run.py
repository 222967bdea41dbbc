"""An example config run as a user runs it, ``relayrl up CONFIG`` in a fresh run directory, and read back: the
shared part of ``relayrl bench guess`` and ``relayrl bench addition``; ``relayrl train <stage>`` run the same way
(``train_stage``: ``relayrl bench pipeline`` and ``preference``); scratch directories kept when a bench fails."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from relayrl.bench.record import machine_record, run_sides
from relayrl.config import load_offline_config
from relayrl.trainer.metrics import read_records

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ExampleRun:
    run_dir: Path  # the run's directory, under ``workdir``
    workdir: Path  # a fresh temp directory: the caller removes it
    wall_s: float  # the whole ``relayrl up``, from launch to exit
    machine: dict  # the fairness record (relayrl/bench/record.py), the load average at the end


def run_example(config: str, overrides: list[str], timeout_s: float, parent: Path | None = None) -> ExampleRun:
    """``relayrl up config`` (plus ``--set`` overrides) to its end in a fresh run directory (under ``parent`` when
    given: a bench's ``scratch``); SystemExit with its stderr's tail when it fails."""
    workdir = Path(tempfile.mkdtemp(prefix="relayrl-bench-example-", dir=parent))
    argv = [sys.executable, "-m", "relayrl.cli", "up", config, "--set", f"run.dir={workdir / 'runs'}"]
    for override in overrides:
        argv += ["--set", override]
    machine = machine_record(None)
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(
            f"relayrl up {config} failed (exit {done.returncode}; its run kept in {workdir}):\n{done.stderr[-3000:]}"
        )
    (run_dir,) = [p for p in (workdir / "runs").iterdir() if p.is_dir()]
    machine |= {"resolved": run_sides(run_dir / "logs"), "loadavg_at_end": list(os.getloadavg())}
    return ExampleRun(run_dir, workdir, wall_s, machine)


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh temporary directory for a bench's runs: removed when the block ends normally, kept when it raises
    (its path printed to stderr), so a failed run can be inspected."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    except BaseException:
        print(f"kept {workdir} (the failed bench's runs)", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)


def run_cli(args: list[str], timeout_s: float | None, log: Path | None = None) -> float:
    """``relayrl ARGS`` in the repository root to its end (None: no time limit), its output written to ``log`` when
    given; its wall seconds, or SystemExit with its stderr's tail."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"relayrl {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def train_stage(stage: str, config: Path, overrides: list[str], workdir: Path, timeout_s: float) -> tuple[Path, float]:
    """``relayrl train <stage> config --set run.dir=workdir`` plus the ``overrides`` (key=value); (its run directory,
    ``workdir`` / its run.name, and its wall seconds). Its output is kept in ``workdir`` / ``train-<stage>.log`` (what
    it resolved: ``record.trainer_side``)."""
    sets = [f"run.dir={workdir}", *overrides]
    args = ["train", stage, str(config)] + [arg for o in sets for arg in ("--set", o)]
    wall = run_cli(args, timeout_s, log=workdir / f"train-{stage}.log")
    return load_offline_config(stage, config, sets).run_dir, wall


def read_lines(path: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's step records and its eval records (``eval``: the set; ``step``: the version measured)."""
    records = read_records(path)
    return [r for r in records if "eval" not in r], [r for r in records if "eval" in r]


def reward_gain(records: list[dict], window: int = 10) -> dict:
    """Mean reward of the first ``window`` and the last ``window`` steps, and the difference."""
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    return {f"reward_first{window}": first, f"reward_last{window}": last, "reward_gain": last - first}


def write_result(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON and write it to ``out`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def publish(result: dict, run: ExampleRun, out: str | None, png: str | None) -> int:
    """``write_result``, the run's reward.png copied to ``png`` when given, then the run's workdir removed;
    returns the exit code 0."""
    write_result(result, out)
    if png:
        shutil.copyfile(run.run_dir / "reward.png", png)
    shutil.rmtree(run.workdir, ignore_errors=True)
    return 0
