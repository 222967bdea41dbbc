"""``relayrl bench sampling``: does the hf engine sample the model's distribution? Sampled response lengths of the
rollout worker's engine against transformers' ``model.generate`` with TRL's sampling, on the same prompts.

The prompts are the first ``--prompts`` of ``--config``'s held-out set ``heldout``, rendered as relayrl renders
them (the training prompts' template and chat template), each sampled ``--n`` times up to ``rollout.max_tokens``
at ``rollout.temperature``: by the hf engine built as ``relayrl rollout serve`` builds it (weight dtype, decode
runner, threads; ``rollout_server.hf_engine_options``), and by ``model.generate`` with ``do_sample``, the same
temperature, ``top_p`` 1 and ``top_k`` 0 (what TRL's ``GRPOTrainer`` passes: trl/trainer/grpo_trainer.py, its
``GenerationConfig``; transformers' own default ``top_k`` is 50). A length counts the tokens up to and including
the end-of-sequence token. Both sides draw from the same distribution when the engine is right, so their mean
lengths differ by a few standard errors at most: the JSON has each side's mean, standard deviation and share of
responses that ended before ``max_tokens``, and the difference of the means in standard errors.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

from relayrl.bench.humaneval import engine_completions, generate_rows, set_prompts, write
from relayrl.bench.record import ROOT, machine_record
from relayrl.config import load_config
from relayrl.ops.args import positive_int
from relayrl.runtime.precision import engine_dtype_name

CONFIG = ROOT / "examples" / "reasoning-smollm2.yaml"
EVAL_SET = "heldout"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="the relayrl config (its held-out set heldout)")
    p.add_argument("--prompts", type=positive_int, default=4, help="held-out prompts")
    p.add_argument("--n", type=positive_int, default=16, help="samples of each prompt, each side")
    p.add_argument("--seed", type=int, default=0, help="torch seed of both sides")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="write the JSON here too")
    return p.parse_args(argv)


def engine_lengths(cfg, prompts: list[list[int]], n: int, dtype: str, seed: int) -> list[tuple[int, bool]]:
    """(length, ended) of each of the hf engine's ``n`` samples a prompt (``ended``: an end-of-sequence token)."""
    import torch

    from relayrl.cores.threads import torch_threads
    from relayrl.wire.sampling import SamplingParams

    torch.manual_seed(seed)
    params = SamplingParams(n=n, temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens)
    done = engine_completions(cfg, prompts, params, dtype, torch_threads(cfg, "rollout"))
    return [(len(c.token_ids), c.finish_reason == "stop") for c in done]


def generate_lengths(cfg, prompts: list[list[int]], n: int, dtype: str, seed: int) -> list[tuple[int, bool]]:
    """(length, ended) of each of ``model.generate``'s ``n`` samples a prompt, sampled as TRL samples."""
    import torch

    from relayrl.cores.threads import torch_threads

    torch.manual_seed(seed)
    rows = generate_rows(
        cfg, [p for p in prompts for _ in range(n)], cfg.rollout.max_tokens, dtype, torch_threads(cfg, "rollout"),
        do_sample=True, temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
    )  # fmt: skip
    return [(len(row), ended) for row, ended in rows]


def side_summary(samples: list[tuple[int, bool]], seconds: float) -> dict:
    lengths = [length for length, _ in samples]
    return {
        "samples": len(samples),
        "length_mean": statistics.mean(lengths),
        "length_sd": statistics.stdev(lengths) if len(lengths) > 1 else 0.0,
        "ended_share": sum(ended for _, ended in samples) / len(samples),
        "seconds": seconds,
    }


def compare(engine: dict, generate: dict) -> float:
    """The difference of the mean lengths (engine - generate) in standard errors of that difference."""
    se = math.sqrt(engine["length_sd"] ** 2 / engine["samples"] + generate["length_sd"] ** 2 / generate["samples"])
    return (engine["length_mean"] - generate["length_mean"]) / se if se else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    dtype = engine_dtype_name(cfg.rollout.weight_dtype, cfg.trainer.precision, "cpu")
    machine = machine_record({"relayrl": {"precision": dtype, "attn_implementation": None}})
    prompts = set_prompts(cfg, args.prompts, EVAL_SET)
    sides = {}
    for name, side in (("engine", engine_lengths), ("generate", generate_lengths)):
        start = time.monotonic()
        samples = side(cfg, prompts, args.n, dtype, args.seed)
        sides[name] = side_summary(samples, time.monotonic() - start)
    machine["loadavg_at_end"] = list(os.getloadavg())
    result = {
        "bench": "sampling",
        "command": f"relayrl bench sampling --config {Path(args.config).resolve().relative_to(ROOT)} "
        f"--prompts {args.prompts} --n {args.n} --seed {args.seed}" + "".join(f" --set {s}" for s in args.overrides),
        "sampling": {
            "temperature": cfg.rollout.temperature,
            "max_tokens": cfg.rollout.max_tokens,
            "top_p": 1.0,
            "generate_top_k": 0,
        },
        "machine": machine,
        **sides,
        "mean_difference_in_se": compare(sides["engine"], sides["generate"]),
    }
    return write(result, args.out)
