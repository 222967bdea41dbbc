"""``relayrl bench pipeline``: SFT then GRPO on SmolLM2-135M-Instruct, as a user runs them (issue 47, item 4).

Stage 1 is ``relayrl train sft examples/pipeline-sft-grpo/sft.yaml`` on worked solutions of the training sums
(``worked_solutions``: "3 + 4 = 7", the form the reward reads), its checkpoints scored on the held-out sums by the RL
config's eval (``eval.config``); stage 2 is ``relayrl up examples/pipeline-sft-grpo/grpo.yaml`` from stage 1's
export. Both stages' held-out greedy accuracy (``mean@1`` of the ``heldout`` set, the same prompts, sampling and
reward) is read from their metrics.jsonl.

Writes JSON: the command, the machine (CPU model and flags, load, the precision and attention each stage's trainer
and engine resolved, from their logs), each stage's
wall seconds and curve (stage step, accuracy), the base model's accuracy (SFT step 0), after SFT, at the RL run's
start (its version 0: the SFT export, so it equals the after-SFT figure when the export is faithful) and after RL.
``--png``: one plot of the held-out accuracy across both stages (x: the SFT steps, then the RL steps after them).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from relayrl.bench.addition import HELDOUT
from relayrl.bench.example_run import ROOT, read_lines, run_example, scratch, train_stage
from relayrl.bench.record import machine_record, trainer_side

DIR = ROOT / "examples" / "pipeline-sft-grpo"
SFT_CONFIG, RL_CONFIG = DIR / "sft.yaml", DIR / "grpo.yaml"
WORKED = DIR / "addition-worked.jsonl"  # worked_solutions of examples/addition-train.jsonl
COMMAND = "relayrl bench pipeline --out bench/results/pipeline-sft-grpo.json --png docs/pipeline-sft-grpo.png"
SUM = re.compile(r"What is (\d+) \+ (\d+)\?")


def worked_solutions(prompts_path: Path) -> list[dict]:
    """One conversation per prompt row ``{"prompt": "What is a + b?", "answer": ...}``: the question and the worked
    answer "a + b = sum", whose last number is the sum (what the last_number reward reads)."""
    rows = []
    for line in prompts_path.read_text().splitlines():
        row = json.loads(line)
        a, b = (int(x) for x in SUM.fullmatch(row["prompt"]).groups())
        assert a + b == int(row["answer"]), row
        solution = f"{a} + {b} = {a + b}"
        rows.append(
            {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": solution}]}
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--sft-set", action="append", default=[], help="key=value overrides of the SFT config")
    p.add_argument("--rl-set", action="append", default=[], help="key=value overrides of the RL config")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="write the plot of both stages here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def curve(evals: list[dict]) -> list[dict]:
    """(step, greedy accuracy) of the held-out set, in step order."""
    points = sorted((r for r in evals if r["eval"] == HELDOUT), key=lambda r: r["step"])
    return [{"step": r["step"], "accuracy": r["mean@1"]} for r in points]


def plot(sft: list[dict], rl: list[dict], sft_steps: int, out: Path) -> None:
    """Held-out accuracy against the stage step: SFT's steps, then RL's after them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([p["step"] for p in sft], [p["accuracy"] for p in sft], marker="o", label="SFT (relayrl train sft)")
    ax.plot([sft_steps + p["step"] for p in rl], [p["accuracy"] for p in rl], marker="o", label="GRPO (relayrl up)")
    ax.axvline(sft_steps, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(f"stage step (SFT steps 0-{sft_steps}, then GRPO steps)")
    ax.set_ylabel("held-out greedy accuracy (mean@1)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SmolLM2-135M-Instruct, held-out sums: SFT then GRPO")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_record(None)
    with scratch("relayrl-bench-pipeline-") as workdir:
        sft_dir, sft_wall = train_stage("sft", SFT_CONFIG, args.sft_set, workdir, args.timeout_s)
        sft_records, sft_evals = read_lines(sft_dir / "metrics.jsonl")
        sft_side = trainer_side(workdir / "train-sft.log")  # what train sft resolved: precision, attention
        rl = run_example(str(RL_CONFIG), [f"model.path={sft_dir / 'final'}", *args.rl_set], args.timeout_s, workdir)
        rl_records, rl_evals = read_lines(rl.run_dir / "metrics.jsonl")
        sft_curve, rl_curve = curve(sft_evals), curve(rl_evals)
        sft_steps = sft_records[-1]["step"]
        trained = [r for r in sft_records if "loss" in r]  # step 0's line, when there is one, holds held-out figures
        result = {
            "bench": "pipeline-sft-grpo",
            "command": COMMAND,
            "configs": [str(SFT_CONFIG.relative_to(ROOT)), str(RL_CONFIG.relative_to(ROOT))],
            "overrides": {"sft": args.sft_set, "rl": args.rl_set},
            "model": "SmolLM2-135M-Instruct",
            "machine": {**machine, **rl.machine, "resolved": {"sft": sft_side, "rl": rl.machine["resolved"]}},
            "sft": {
                "steps": sft_steps,
                "wall_s": sft_wall,
                "loss_first": trained[0]["loss"],
                "loss_last": trained[-1]["loss"],
                "heldout_curve": sft_curve,
            },
            "rl": {"steps": len(rl_records), "wall_s": rl.wall_s, "heldout_curve": rl_curve},
            "heldout_base": sft_curve[0]["accuracy"],
            "heldout_after_sft": sft_curve[-1]["accuracy"],
            "heldout_rl_start": rl_curve[0]["accuracy"],
            "heldout_after_rl": rl_curve[-1]["accuracy"],
        }
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        if args.png:
            plot(sft_curve, rl_curve, sft_steps, Path(args.png))
    return 0
