"""``relayrl bench preference``: preference pairs from SmolLM2-135M-Instruct's own samples, DPO on them, a reward
model from them, and GRPO whose only reward is that reward model, served (issue 46 item 7, issue 47 item 4).

1. **Pairs.** ``relayrl eval examples/addition-smollm2.yaml --checkpoint <the base model> --generations`` samples
   every training and held-out sum ``--n`` times at temperature 1 on a rollout worker process (hf engine) and
   scores each sample with the task's verifier (``last_number``); ``preference_pairs`` pairs, per prompt, a sample
   the verifier passes (chosen) with one it fails (rejected), as TRL's conversational preference rows. Nothing is
   hand-written: held-out pairs come from the held-out sums.
2. **DPO**: ``relayrl train dpo examples/preference-smollm2/dpo.yaml`` on the pairs, its checkpoints scored greedily
   on the held-out sums by the addition example's eval (the run's own eval section).
3. **Reward model**: ``relayrl train rm examples/preference-smollm2/rm.yaml`` from SmolLM2 itself; its held-out
   pair accuracy (``eval_accuracy``).
4. **GRPO**: ``relayrl up examples/preference-smollm2/grpo-rm.yaml``, the reward model served by
   ``relayrl reward serve`` under ``up`` as the only reward (the verifier weighted 0, measured only), the held-out
   verifier accuracy (``last_number/mean@1``) before and after.

Writes JSON (the command, the machine, every stage's wall seconds and figures) and, with ``--png``, one figure:
held-out greedy accuracy over the DPO and GRPO steps, and the reward model's held-out pair accuracy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from relayrl.bench.addition import CONFIG as ADDITION
from relayrl.bench.addition import HELDOUT, heldout_accuracy
from relayrl.bench.example_run import ROOT, read_lines, run_cli, run_example, scratch, train_stage, write_result
from relayrl.bench.record import machine_record

DIR = ROOT / "examples" / "preference-smollm2"
DPO_CONFIG, RM_CONFIG, GRPO_CONFIG = DIR / "dpo.yaml", DIR / "rm.yaml", DIR / "grpo-rm.yaml"
TRAIN = "train"  # the sampled set of the training sums; HELDOUT the held-out sums'
SETS = {TRAIN: "examples/addition-train.jsonl", HELDOUT: "examples/addition-heldout.jsonl"}
VERIFIER_ACCURACY = "last_number/mean@1"  # grpo-rm.yaml's eval: the verifier's greedy accuracy, weighted 0
COMMAND = (
    "relayrl bench preference --out bench/results/preference-smollm2.json --png docs/preference-smollm2.png "
    "--pairs-out bench/results/preference-smollm2-pairs.jsonl"
)


def preference_pairs(rows: list[dict], passed: float = 1.0, per_prompt: int = 2) -> list[dict]:
    """TRL conversational preference rows from scored samples: ``rows`` as ``relayrl eval --generations`` writes
    them (``prompt``; ``samples``, each a ``response`` and its ``reward``). Per prompt, with C its distinct
    responses with reward >= ``passed`` (chosen, in sample order) and R its distinct responses below it
    (rejected), pair i is (C[i mod |C|], R[i mod |R|]) for i < min(``per_prompt``, max(|C|, |R|)): every distinct
    response is in a pair before any pair repeats one, and no two pairs are the same. A prompt whose samples all
    pass or all fail gives none."""
    pairs = []
    for row in rows:
        chosen = list(dict.fromkeys(s["response"] for s in row["samples"] if s["reward"] >= passed))
        rejected = list(dict.fromkeys(s["response"] for s in row["samples"] if s["reward"] < passed))
        if not chosen or not rejected:
            continue
        count = min(per_prompt, max(len(chosen), len(rejected)))
        for good, bad in ((chosen[i % len(chosen)], rejected[i % len(rejected)]) for i in range(count)):
            pairs.append(
                {
                    "prompt": [{"role": "user", "content": row["prompt"]}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
    return pairs


def length_baselines(pairs: list[dict], length: Callable[[str], int] = len) -> dict[str, float]:
    """The pair accuracy of two scorers that read only a response's ``length`` (characters by default):
    ``shorter_wins`` (the share of pairs whose chosen response is the shorter) and ``longer_wins``; ties count
    for neither. A reward model's accuracy is worth what it adds over the larger of the two."""
    lengths = [(length(p["chosen"][-1]["content"]), length(p["rejected"][-1]["content"])) for p in pairs]
    count = max(len(lengths), 1)
    return {
        "shorter_wins": sum(c < r for c, r in lengths) / count,
        "longer_wins": sum(c > r for c, r in lengths) / count,
    }


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench preference", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16, help="samples per prompt the pairs are made from")
    p.add_argument("--pairs-per-prompt", type=int, default=4)
    p.add_argument("--dpo-set", action="append", default=[], help="key=value overrides of dpo.yaml")
    p.add_argument("--rm-set", action="append", default=[], help="key=value overrides of rm.yaml")
    p.add_argument("--grpo-set", action="append", default=[], help="key=value overrides of grpo-rm.yaml")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="write the figure here")
    p.add_argument("--pairs-out", help="write the training and held-out pairs here (one JSONL, a split column)")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def sample(n: int, workdir: Path, timeout_s: float) -> tuple[dict, float]:
    """The base model's ``n`` samples at temperature 1 of every training and held-out sum, verifier-scored, through
    ``relayrl eval`` (a rollout worker process); (its report with generations, wall seconds)."""
    from relayrl.config import load_config
    from relayrl.models.assets import prepare_model

    cfg = load_config(ADDITION)
    prepare_model(cfg)  # the builtin's cached directory: the checkpoint relayrl eval serves
    out = workdir / "samples.json"
    sets = "{" + ", ".join(f"{name}: {{path: {path}}}" for name, path in SETS.items()) + "}"
    # every prompt's samples queue on one worker: a loaded machine outlasts the default Generate deadline (300 s),
    # and a timed-out prompt gives no pairs
    overrides = [f"eval.n={n}", "eval.temperature=1.0", "eval.metrics=[mean]", f"eval.sets={sets}"]
    overrides.append("controller.generate_timeout_s=3600")
    wall = run_cli(
        ["eval", str(ADDITION), "--checkpoint", cfg.model.path, "--generations", "--out", str(out)]
        + [arg for o in overrides for arg in ("--set", o)],
        timeout_s,
    )
    return json.loads(out.read_text()), wall


def dpo_summary(run_dir: Path, wall_s: float) -> dict:
    """The DPO run's held-out greedy accuracy (its eval section) and its held-out pair metrics, first and last."""
    records, evals = read_lines(run_dir / "metrics.jsonl")
    scored = [r for r in records if "eval_rewards/accuracies" in r]
    return {
        "steps": records[-1]["step"],
        "wall_s": wall_s,
        **heldout_accuracy(evals),
        "heldout_pair_accuracy_before": scored[0]["eval_rewards/accuracies"],
        "heldout_pair_accuracy_after": scored[-1]["eval_rewards/accuracies"],
        "heldout_margin_after": scored[-1]["eval_rewards/margins"],
    }


def rm_summary(run_dir: Path, wall_s: float) -> dict:
    """The reward model's held-out pair accuracy (eval_accuracy) by step, first and last."""
    records, _ = read_lines(run_dir / "metrics.jsonl")
    scored = [{"step": r["step"], "accuracy": r["eval_accuracy"]} for r in records if "eval_accuracy" in r]
    return {
        "steps": records[-1]["step"],
        "wall_s": wall_s,
        "heldout_pair_accuracy_before": scored[0]["accuracy"],
        "heldout_pair_accuracy_after": scored[-1]["accuracy"],
        "heldout_pair_accuracy_curve": scored,
        "heldout_margin_after": next(r["eval_margin"] for r in reversed(records) if "eval_margin" in r),
    }


def heldout_baselines(pairs: list[dict], reward_model: Path) -> dict[str, dict[str, float]]:
    """``length_baselines`` of the held-out pairs by characters and by tokens of the reward model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reward_model))
    return {
        "characters": length_baselines(pairs),
        "tokens": length_baselines(pairs, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])),
    }


def pair_counts(report: dict, pairs: dict[str, list[dict]], n: int) -> dict:
    """Per set: prompts scored and failed (no samples: a generation that failed), samples per prompt, the verifier's
    pass rate of the samples, pairs made."""
    counts = {}
    for name, rows in report["generations"].items():
        rewards = [s["reward"] for row in rows for s in row["samples"]]
        counts[name] = {
            "prompts": len(rows),
            "prompts_failed": report["results"][name]["prompts_failed"],
            "samples_per_prompt": n,
            "sample_pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
            "pairs": len(pairs[name]),
        }
    return counts


def plot(dpo: dict, rm: dict, grpo: dict, out: Path) -> None:
    """Left: held-out greedy accuracy over DPO's and GRPO's steps; right: the reward model's held-out pair
    accuracy over its steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for label, curve in (
        ("DPO on self-sampled pairs", dpo["heldout_curve"]),
        ("GRPO, served RM only", grpo["heldout_curve"]),
    ):
        left.plot([p["policy_version"] for p in curve], [p["accuracy"] for p in curve], marker="o", label=label)
    left.set_xlabel("training step")
    left.set_ylabel("held-out greedy accuracy (verifier)")
    left.set_ylim(-0.02, 1.02)
    left.set_title("SmolLM2-135M-Instruct, held-out sums")
    left.legend(loc="lower right")
    curve = rm["heldout_pair_accuracy_curve"]
    right.plot([p["step"] for p in curve], [p["accuracy"] for p in curve], marker="o", color="C2")
    right.axhline(0.8, color="grey", linestyle=":", linewidth=1, label="target 0.8")
    right.set_xlabel("reward-model step")
    right.set_ylabel("held-out pair accuracy")
    right.set_ylim(-0.02, 1.02)
    right.set_title("reward model from SmolLM2 (relayrl train rm)")
    right.legend(loc="lower right")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_record(None)
    with scratch("relayrl-bench-preference-") as workdir:
        report, sample_wall = sample(args.n, workdir, args.timeout_s)
        pairs = {
            name: preference_pairs(rows, per_prompt=args.pairs_per_prompt)
            for name, rows in report["generations"].items()
        }
        paths = {name: workdir / f"pairs-{name}.jsonl" for name in pairs}
        for name, path in paths.items():
            write_jsonl(pairs[name], path)
        if args.pairs_out:
            write_jsonl([{**p, "split": name} for name, rows in pairs.items() for p in rows], Path(args.pairs_out))
        data = [f"data.path={paths[TRAIN]}", f"data.eval_path={paths[HELDOUT]}"]
        dpo_dir, dpo_wall = train_stage("dpo", DPO_CONFIG, data + args.dpo_set, workdir, args.timeout_s)
        rm_dir, rm_wall = train_stage("rm", RM_CONFIG, data + args.rm_set, workdir, args.timeout_s)
        served = [f"scorers.rm.model={rm_dir / 'final'}", *args.grpo_set]
        grpo = run_example(str(GRPO_CONFIG), served, args.timeout_s, workdir)
        records, evals = read_lines(grpo.run_dir / "metrics.jsonl")
        dpo, rm = dpo_summary(dpo_dir, dpo_wall), rm_summary(rm_dir, rm_wall)
        rm["heldout_pairs"] = len(pairs[HELDOUT])
        rm["heldout_length_baselines"] = heldout_baselines(pairs[HELDOUT], rm_dir / "final")
        grpo_figures = {
            "steps": len(records),
            "wall_s": grpo.wall_s,
            **heldout_accuracy(evals, VERIFIER_ACCURACY),
            "rm_score_first": records[0]["reward_mean"],
            "rm_score_last": records[-1]["reward_mean"],
            "train_verifier_first": records[0]["rewards/last_number"],
            "train_verifier_last": records[-1]["rewards/last_number"],
        }
        result = {
            "bench": "preference-smollm2",
            "command": COMMAND,
            "configs": [str(c.relative_to(ROOT)) for c in (ADDITION, DPO_CONFIG, RM_CONFIG, GRPO_CONFIG)],
            "overrides": {"dpo": args.dpo_set, "rm": args.rm_set, "grpo": args.grpo_set},
            "model": "SmolLM2-135M-Instruct",
            "machine": {**machine, **grpo.machine},
            "sampling": {"wall_s": sample_wall, "temperature": 1.0, **pair_counts(report, pairs, args.n)},
            "dpo": dpo,
            "reward_model": rm,
            "grpo_served_rm": grpo_figures,
        }
        write_result(result, args.out)
        if args.png:
            plot(dpo, rm, grpo_figures, Path(args.png))
    return 0
