"""``relayrl bench distill``: on-policy distillation as a user runs it. ``relayrl up examples/digits.yaml`` trains
the teacher (GRPO on the CPU demo's task), then ``relayrl up examples/digits-distill.yaml`` distils a fresh tiny
student from the teacher's export, served by a scorer of kind teacher that ``relayrl up`` starts.

Writes JSON: the command, the machine's load, each run's wall seconds, the teacher's held-out greedy accuracy
after its training, the student's before, during and after (the runs' own evals: ``mean@1`` of
``eval.sets.heldout``), the student's mean reverse KL per token (``KL_KEY``, the trainer's metric) of its first and
last 10 steps, and every student step's reward and reverse KL. ``--teacher DIR`` distils from an existing export
(``<run dir>/final`` of a ``relayrl up examples/digits.yaml``) instead of training one. ``--png`` copies the
student run's reward.png (reward per step and the held-out curve).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from pathlib import Path

from relayrl.bench.addition import heldout_accuracy
from relayrl.bench.example_run import ROOT, publish, read_lines, reward_gain, run_example

TEACHER_CONFIG = ROOT / "examples" / "digits.yaml"
STUDENT_CONFIG = ROOT / "examples" / "digits-distill.yaml"
TEACHER_COMMAND = "relayrl up examples/digits.yaml"
COMMAND = "relayrl bench distill --out bench/results/distill-digits.json --png docs/distill-digits.png"
KL_KEY = "distill/reverse_kl"  # the trainer's mean reverse KL per response token, log pi_student - log pi_teacher
WINDOW = 10  # steps averaged at the start and at the end


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench distill", description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="an existing teacher export (default: train one with examples/digits.yaml)")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value student overrides")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--png", help="copy the student run's reward.png here")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(argv)


def reverse_kl(records: list[dict]) -> dict:
    """The mean of ``KL_KEY`` over the first and the last ``WINDOW`` steps."""
    kls = [r[KL_KEY] for r in records]
    return {"reverse_kl_first10": statistics.fmean(kls[:WINDOW]), "reverse_kl_last10": statistics.fmean(kls[-WINDOW:])}


def summarize_student(records: list[dict], evals: list[dict], wall_s: float) -> dict:
    """The student run: its steps, wall seconds, reward and reverse KL windows, held-out curve, and every step."""
    return {
        "steps": len(records),
        "wall_s": wall_s,
        **reward_gain(records),
        **reverse_kl(records),
        **heldout_accuracy(evals),
        "per_step": [{"step": r["step"], "reward_mean": r["reward_mean"], KL_KEY: r[KL_KEY]} for r in records],
    }


def teacher_record(export: Path, wall_s: float | None) -> dict:
    """The teacher: its export, the config that trained it, its run's wall seconds (when this bench ran it), and
    its held-out accuracy from its run's metrics.jsonl (the export's parent directory, when there is one)."""
    metrics = export.parent / "metrics.jsonl"
    evals = read_lines(metrics)[1] if metrics.exists() else []
    return {"export": str(export), "trained_by": TEACHER_COMMAND, "wall_s": wall_s, **heldout_accuracy(evals)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.teacher is None:
        run = run_example(str(TEACHER_CONFIG), [], args.timeout_s)
        teacher_workdir, teacher = run.workdir, teacher_record(run.run_dir / "final", run.wall_s)
    else:
        teacher_workdir, teacher = None, teacher_record(Path(args.teacher), None)
    try:
        overrides = [f"scorers.teacher.model={teacher['export']}", *args.overrides]
        student = run_example(str(STUDENT_CONFIG), overrides, args.timeout_s)
    finally:
        if teacher_workdir is not None:
            shutil.rmtree(teacher_workdir, ignore_errors=True)
    records, evals = read_lines(student.run_dir / "metrics.jsonl")
    result = {
        "bench": "distill",
        "command": COMMAND if args.teacher is None else f"{COMMAND} --teacher {args.teacher}",
        "config": os.path.relpath(STUDENT_CONFIG, ROOT),
        "overrides": args.overrides,
        "machine": student.machine,
        "teacher": teacher,
        "student": summarize_student(records, evals, student.wall_s),
    }
    return publish(result, student, args.out, args.png)
