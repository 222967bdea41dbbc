"""``relayrl bench distill``: on-policy distillation as a user runs it. A teacher is trained, then a student learns
from the teacher's export, served by a scorer of kind teacher that ``relayrl up`` starts, with no reward in its loss.

``--example digits`` (the default): the teacher is ``relayrl up examples/digits.yaml`` (GRPO on the CPU demo's
task), the student a fresh tiny Qwen2 (``examples/digits-distill.yaml``). ``--example smollm2``: the teacher is
SmolLM2-135M-Instruct after ``relayrl train sft`` on worked solutions of the training sums
(``examples/pipeline-sft-grpo/sft.yaml`` with ``TEACHER_SFT_SET``), the student the model as built
(``examples/addition-distill.yaml``); both are scored on the same held-out sums, greedily.

Writes JSON: the command, the machine (its load at the bench's start and at its end, the precision the teacher's
training, the student's trainer and its engine resolved), the teacher's wall seconds and held-out greedy accuracy
before and after its training, the student's before, during and after (the runs' own evals: ``mean@1`` of
``eval.sets.heldout``), the student's mean reward and mean reverse KL per token (``KL_KEY``, the trainer's metric)
over its first and last ``window`` steps (``WINDOW``, or half the steps in a shorter run), and every student step's
reward and reverse KL. ``--teacher DIR`` distils from an existing export (``<run dir>/final`` of the example's
teacher command) instead of training one. ``--png``: the student's held-out accuracy per policy version against
the teacher's, and its reverse KL per step (``plot``, drawn from the JSON alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relayrl.bench.addition import heldout_accuracy
from relayrl.bench.example_run import ROOT, read_lines, reward_gain, run_example, scratch, train_stage, write_result
from relayrl.bench.pipeline import SFT_CONFIG
from relayrl.bench.record import machine_record, trainer_side

KL_KEY = "distill/reverse_kl"  # the trainer's mean reverse KL per response token, log pi_student - log pi_teacher
WINDOW = 10  # steps averaged at the start and at the end (half the steps when the run has fewer than 2 * WINDOW)
# the SmolLM2 teacher: two steps of the pipeline's SFT stage at a higher lr (one step at 1e-5 is the pipeline's gentle
# start, which leaves its RL stage room; a teacher should be as good as is cheap)
TEACHER_SFT_SET = ("run.name=distill-teacher", "trainer.steps=2", "trainer.lr=0.00003")


@dataclass
class Teacher:
    export: Path  # the teacher's Hugging Face export, the scorer's model
    wall_s: float | None  # its training's wall seconds (None: an existing export)
    resolved: dict  # side -> what its training computed in (relayrl/bench/record.py)


@dataclass(frozen=True)
class Example:
    student_config: Path
    teacher_command: str  # the command that trains the teacher, as a user runs it
    name: str  # the JSON's and the PNG's file name
    title: str  # the plot's
    train_teacher: Callable[[Path, float], Teacher]  # (scratch directory, timeout_s) -> the trained teacher


def digits_teacher(workdir: Path, timeout_s: float) -> Teacher:
    """GRPO on the CPU demo's task: ``relayrl up examples/digits.yaml``."""
    run = run_example(str(ROOT / "examples" / "digits.yaml"), [], timeout_s, workdir)
    return Teacher(run.run_dir / "final", run.wall_s, run.machine["resolved"])


def smollm2_teacher(workdir: Path, timeout_s: float) -> Teacher:
    """SmolLM2-135M-Instruct fine-tuned on worked solutions: ``relayrl train sft`` with ``TEACHER_SFT_SET``."""
    run_dir, wall_s = train_stage("sft", SFT_CONFIG, list(TEACHER_SFT_SET), workdir, timeout_s)
    return Teacher(run_dir / "final", wall_s, {"teacher-sft": trainer_side(workdir / "train-sft.log")})


EXAMPLES = {
    "digits": Example(
        ROOT / "examples" / "digits-distill.yaml",
        "relayrl up examples/digits.yaml",
        "distill-digits",
        "tiny Qwen2 student, digits task",
        digits_teacher,
    ),
    "smollm2": Example(
        ROOT / "examples" / "addition-distill.yaml",
        f"relayrl train sft {SFT_CONFIG.relative_to(ROOT)} " + " ".join(f"--set {o}" for o in TEACHER_SFT_SET),
        "distill-smollm2",
        "SmolLM2-135M-Instruct student, held-out sums",
        smollm2_teacher,
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench distill", description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=sorted(EXAMPLES), default="digits", help="which teacher and student")
    p.add_argument("--teacher", help="an existing teacher export (default: train one with the example's command)")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value student overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="write the plot here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def command(example: str, teacher: str | None) -> str:
    """The bench command that writes the example's committed JSON and PNG."""
    name = EXAMPLES[example].name
    line = f"relayrl bench distill --example {example} --out bench/results/{name}.json --png docs/{name}.png"
    return line if teacher is None else f"{line} --teacher {teacher}"


def reverse_kl(records: list[dict], window: int) -> dict:
    """The mean of ``KL_KEY`` over the first and the last ``window`` steps."""
    kls = [r[KL_KEY] for r in records]
    return {
        f"reverse_kl_first{window}": statistics.fmean(kls[:window]),
        f"reverse_kl_last{window}": statistics.fmean(kls[-window:]),
    }


def summarize_student(records: list[dict], evals: list[dict], wall_s: float) -> dict:
    """The student run: its steps, wall seconds, reward and reverse KL windows, held-out curve, and every step."""
    window = min(WINDOW, max(1, len(records) // 2))
    return {
        "steps": len(records),
        "wall_s": wall_s,
        "window": window,
        **reward_gain(records, window),
        **reverse_kl(records, window),
        **heldout_accuracy(evals),
        "per_step": [{"step": r["step"], "reward_mean": r["reward_mean"], KL_KEY: r[KL_KEY]} for r in records],
    }


def teacher_record(teacher: Teacher, trained_by: str) -> dict:
    """The teacher: its export, the command that trained it, its wall seconds (when this bench trained it), and its
    held-out accuracy from its run's metrics.jsonl (the export's parent directory, when there is one)."""
    metrics = teacher.export.parent / "metrics.jsonl"
    evals = read_lines(metrics)[1] if metrics.exists() else []
    record = {"export": str(teacher.export), "trained_by": trained_by, "wall_s": teacher.wall_s}
    return record | heldout_accuracy(evals)


def plot(result: dict, title: str, out: Path) -> None:
    """Left: the student's held-out greedy accuracy per policy version, the teacher's after its training as a line.
    Right: the student's mean reverse KL per token, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    student, teacher = result["student"], result["teacher"]
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    curve = student["heldout_curve"]
    acc.plot([p["policy_version"] for p in curve], [p["accuracy"] for p in curve], marker="o", label="student")
    if teacher["heldout_after"] is not None:
        acc.axhline(teacher["heldout_after"]["accuracy"], color="C1", linestyle="--", label="teacher")
    acc.set_xlabel("student policy version (step)")
    acc.set_ylabel("held-out greedy accuracy (mean@1)")
    acc.set_ylim(-0.02, 1.02)
    acc.legend(loc="lower right")
    steps = student["per_step"]
    kl.plot([s["step"] for s in steps], [s[KL_KEY] for s in steps], color="C2")
    kl.set_xlabel("student step")
    kl.set_ylabel("reverse KL per sampled token (nats)")
    kl.set_ylim(bottom=0)
    for ax in (acc, kl):
        ax.grid(alpha=0.3)
    fig.suptitle(f"On-policy distillation, {title}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    example = EXAMPLES[args.example]
    machine = machine_record(None)
    with scratch("relayrl-bench-distill-") as workdir:
        if args.teacher is None:
            teacher = example.train_teacher(workdir, args.timeout_s)
        else:
            teacher = Teacher(Path(args.teacher), None, {})
        overrides = [f"scorers.teacher.model={teacher.export}", *args.overrides]
        student = run_example(str(example.student_config), overrides, args.timeout_s, workdir)
        result = {
            "bench": "distill",
            "example": args.example,
            "command": command(args.example, args.teacher),
            "config": os.path.relpath(example.student_config, ROOT),
            "overrides": args.overrides,
            "machine": {
                **student.machine,
                "loadavg_at_start": machine["loadavg_at_start"],
                "resolved": {**teacher.resolved, **student.machine["resolved"]},
            },
            "teacher": teacher_record(teacher, example.teacher_command),
            "student": summarize_student(*read_lines(student.run_dir / "metrics.jsonl"), student.wall_s),
        }
        write_result(result, args.out)
        if args.png:
            plot(result, example.title, Path(args.png))
    return 0
