"""``relayrl bench rollout-correction``: the real-model example (``examples/addition-smollm2.yaml``,
SmolLM2-135M-Instruct) trained off-policy, the same seed twice, without and with the rollout correction
(docs/algorithms.md, "Rollout correction"), both runs at once so they share the machine's load alike.

Both runs: ``controller.max_staleness: 2`` with in-flight weight updates (``rollout.partial: keep_kv``: a response
spans several policy versions), the engine's weights in bf16 (``rollout.weight_dtype: bfloat16``), the trainer at
the machine's precision (``trainer.precision: auto``: bf16 compute where the CPU runs it natively, else float32,
as the trainer logs and ``machine.resolved`` records), and decoupled old log-probs (``algorithm.old_logprobs:
recompute``, verl's default mode: the IS weights apply to every mini-batch). The corrected run adds verl's
decoupled token TIS (``rollout_is: token``, truncated at 2.0, verl's and TRL's cap) and token-level k3 rejection
(``rollout_rs: token_k3`` at 0.1: a token whose ratio π_trainer / π_engine leaves about [0.64, 1.5] leaves the loss
and its denominator).

Writes JSON: per run, the reward of the first and last 10 steps, the held-out greedy accuracy before, during and
after, the mean ``rollout_corr/*`` diagnostics (and ``logprob_mismatch``) of the first and the last 10 steps (the
drift), and every step's reward, staleness and diagnostics; the command, the overrides and the machine (CPU model
and flags, each side's resolved precision). ``--png`` plots it (``plot``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from relayrl.bench.addition import CONFIG, heldout_accuracy
from relayrl.bench.example_run import ROOT, ExampleRun, read_lines, reward_gain, run_example, write_result
from relayrl.config import CORRECTION_PREFIX

COMMAND = (
    "relayrl bench rollout-correction --out bench/results/rollout-correction.json --png docs/rollout-correction.png"
)
STEPS = 100
SHARED = (
    "controller.max_staleness=2",
    "rollout.partial=keep_kv",
    "rollout.weight_dtype=bfloat16",
    "trainer.precision=auto",
    "algorithm.old_logprobs=recompute",
)
CORRECTION = (
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_is_mode=truncate",
    "algorithm.rollout_correction.rollout_rs=token_k3",
    "algorithm.rollout_correction.rollout_rs_threshold=0.1",
)
RUNS = {"uncorrected": (), "corrected": CORRECTION}  # run name -> its overrides beyond SHARED
# what each step record contributes: the drift's context (staleness, in-flight rows) and the mismatch
STEP_KEYS = ("step", "reward_mean", "stale_token_share", "mixed_version_samples", "logprob_mismatch")
WINDOW = 10  # steps averaged at the start and at the end


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench rollout-correction", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the example's config")
    p.add_argument("--steps", type=int, default=STEPS, help="trainer steps of each run")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value overrides of both runs")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="plot the JSON here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def diagnostics(record: dict) -> dict[str, float]:
    """A step's mismatch: its ``rollout_corr/*`` and ``logprob_mismatch``."""
    return {k: v for k, v in record.items() if k.startswith(CORRECTION_PREFIX) or k == "logprob_mismatch"}


def window_means(records: list[dict]) -> dict[str, float]:
    """Each diagnostic's mean over ``records``."""
    keys = diagnostics(records[0]).keys()
    return {k: statistics.fmean(r[k] for r in records) for k in keys}


def summarize(run: ExampleRun) -> dict:
    """One run's figures (module docstring)."""
    records, evals = read_lines(run.run_dir / "metrics.jsonl")
    return {
        "steps": len(records),
        "wall_s": run.wall_s,
        **reward_gain(records),
        **heldout_accuracy(evals),
        f"diagnostics_first{WINDOW}": window_means(records[:WINDOW]),
        f"diagnostics_last{WINDOW}": window_means(records[-WINDOW:]),
        "resolved": run.machine["resolved"],
        "loadavg_at_end": run.machine["loadavg_at_end"],
        "per_step": [{**{k: r.get(k) for k in STEP_KEYS}, **diagnostics(r)} for r in records],
    }


def column(run: dict, key: str) -> list[float]:
    """``key`` of every step of a summarized run."""
    return [s[key] for s in run["per_step"]]


def plot(result: dict, out: Path) -> Path:
    """Four panels, both runs in each: reward per step (its 10-step mean), held-out greedy accuracy by policy
    version, the mismatch ``rollout_corr/kl_k3`` per step, and the share of tokens the correction rejected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=110)
    colors = {"uncorrected": "tab:gray", "corrected": "tab:blue"}
    for name, run in result["runs"].items():
        steps, rewards = column(run, "step"), column(run, "reward_mean")
        smooth = [statistics.fmean(rewards[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(rewards))]
        axes[0, 0].plot(steps, smooth, color=colors[name], label=name)
        curve = run["heldout_curve"]
        axes[0, 1].plot([c["policy_version"] for c in curve], [c["accuracy"] for c in curve], marker="o",
                        color=colors[name], label=name)  # fmt: skip
        axes[1, 0].plot(steps, column(run, CORRECTION_PREFIX + "kl_k3"), color=colors[name], label=name)
        axes[1, 1].plot(steps, column(run, CORRECTION_PREFIX + "rejected_token_share"), color=colors[name], label=name)
    titles = (
        f"reward per step ({WINDOW}-step mean)",
        "held-out greedy accuracy (20 unseen sums)",
        f"{CORRECTION_PREFIX}kl_k3: KL(engine ‖ trainer) per token",
        f"{CORRECTION_PREFIX}rejected_token_share",
    )
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step (= policy version)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, max_staleness 2, in-flight updates, bf16 engine: without / with correction")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shared = [*SHARED, f"trainer.steps={args.steps}", *args.overrides]
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {
            name: pool.submit(run_example, args.config, [*shared, f"run.name=rc-{name}", *extra], args.timeout_s)
            for name, extra in RUNS.items()
        }
        runs = {name: future.result() for name, future in futures.items()}
    result = {
        "bench": "rollout-correction",
        "command": COMMAND + (f" --steps {args.steps}" if args.steps != STEPS else ""),
        "config": os.path.relpath(args.config, ROOT),
        "overrides": {"both": shared, "corrected": list(CORRECTION)},
        "machine": {k: v for k, v in runs["corrected"].machine.items() if k not in ("resolved", "loadavg_at_end")},
        "runs": {name: summarize(run) for name, run in runs.items()},
    }
    write_result(result, args.out)
    if args.png:
        plot(result, Path(args.png))
    for run in runs.values():
        shutil.rmtree(run.workdir, ignore_errors=True)
    return 0
