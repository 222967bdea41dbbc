"""What ``relayrl bench sft`` and ``relayrl bench dpo`` share: one epoch of program-written rows through ``relayrl
train <verb>`` and through TRL's trainer of the same job in each of its modes, each side its own process, on the same
model, float32, AdamW at a constant lr, gradient clipping 1.0 (issue 47, item 5).

The data: texts of long-tailed lengths, ``--min-words`` to ``--max-words`` words drawn log-uniformly (many short, a
few long: the shape of chat data), written by a program (``long_tailed_text``) into one JSONL file both sides read.

Figures per side: the example tokens trained (the rows' own tokens: the same count on every side), the positions
computed (padding included), the seconds of the optimizer steps (each step from its first forward to the end of its
optimizer step, summed; the first step left out as warm-up on every side), tokens/s = the tokens of the steps
timed / their seconds, and the median of the timed steps' own tokens/s (``step_figures``: on a shared machine a few
steps slowed by other processes move the sum, not the median). ``speedup`` and ``speedup_median`` are relayrl's
figures over each TRL mode's; ``positions_per_token`` each side's positions computed / tokens. ``--threads N`` runs
every side on N threads (relayrl ``trainer.threads``, TRL ``torch.set_num_threads``); unset, each its default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.bench.example_run import ROOT, run_cli, scratch
from relayrl.bench.record import machine_record

LR = 2e-5  # both sides' constant learning rate
WORDS = [  # the texts' words
    "the", "river", "runs", "past", "an", "old", "mill", "where", "children", "learn", "to", "count", "stones", "and",
    "birds", "while", "the", "wind", "turns", "every", "page", "of", "a", "long", "story", "about", "seven", "small",
    "boats", "that", "sail", "home", "before", "dark",
]  # fmt: skip


def long_tailed_text(rng: random.Random, min_words: int, max_words: int) -> str:
    """A text of min_words..max_words words, the count drawn log-uniformly, ending in a full stop."""
    words = round(min_words * (max_words / min_words) ** rng.random())
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


@dataclass(frozen=True)
class Versus:
    """One bench: relayrl's offline stage ``verb`` against TRL's trainer of the same job."""

    verb: str  # ``relayrl train <verb>`` and ``relayrl bench <verb>``
    rows: Callable[[argparse.Namespace], list[dict]]  # the data set of the arguments (TRL's format)
    trl_modes: Callable[[dict], dict[str, dict]]  # relayrl's figures -> {TRL mode: its spec's extra keys}
    trl_side: Callable[[dict], dict]  # one TRL mode's figures from its spec, in its own process (``--side``)
    relayrl_sections: dict  # config sections of ``relayrl train <verb>`` beside run/model/data/trainer (DPO: loss)


def bench_arguments(
    prog: str, description: str, *, examples: int, max_words: int, batch_tokens: int = 2048, pack_tokens: int = 1024
) -> argparse.ArgumentParser:
    """The arguments every such bench takes (``examples``, ``max_words``, ``batch_tokens``, ``pack_tokens``: their
    defaults)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model.path of both sides")
    p.add_argument("--examples", type=int, default=examples)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=max_words)
    p.add_argument("--batch-tokens", type=int, default=batch_tokens, help="tokens a step (trainer.batch_tokens)")
    p.add_argument("--pack-tokens", type=int, default=pack_tokens, help="row length (pack_tokens; TRL SFT max_length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads of every side (default: each side's own default)")
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one TRL side from a spec file
    return p


def relayrl_side(versus: Versus, spec: dict, workdir: Path) -> dict:
    """``relayrl train <verb>`` over one epoch; its figures from metrics.jsonl (packed rows: no padding)."""
    config = {
        "run": {"name": f"bench-{versus.verb}", "dir": str(workdir / "runs"), "seed": spec["seed"]},
        "model": {"path": spec["model"]},
        "data": {"path": spec["data"], "shuffle": True},
        "trainer": {
            "epochs": 1, "batch_tokens": spec["batch_tokens"], "pack_tokens": spec["pack_tokens"], "lr": LR,
            "lr_schedule": "constant", "precision": "float32", "export_hf": False, "threads": spec["threads"] or "auto",
        },
        **versus.relayrl_sections,
    }  # fmt: skip
    path = workdir / f"{versus.verb}.yaml"
    path.write_text(json.dumps(config))
    run_cli(["train", versus.verb, str(path)], timeout_s=None)
    metrics = workdir / "runs" / f"bench-{versus.verb}" / "metrics.jsonl"
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    return {
        "steps": len(steps),
        "examples_per_step": sum(r["examples"] for r in steps) / len(steps),
        "rows_per_step": sum(r["rows"] for r in steps) / len(steps),
        "tokens": sum(r["tokens"] for r in steps),
        "positions_computed": sum(r["tokens"] for r in steps),
        **step_figures([(r["step_seconds"], r["tokens"]) for r in steps]),
        "precision": "float32",
    }


def step_figures(steps: list[tuple[float, int]]) -> dict[str, Any]:
    """The timed figures of a side's (seconds, tokens) steps, the first left out as warm-up: their tokens and
    seconds, tokens/s = Σ tokens / Σ seconds, the median of the steps' own tokens/s, and each step's seconds."""
    timed = steps[1:]
    if not timed:
        raise ValueError(f"steps: {len(steps)} step(s), at least 2 needed (the first is warm-up)")
    tokens, seconds = sum(t for _, t in timed), sum(s for s, _ in timed)
    return {
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "median_step_tokens_per_s": statistics.median(t / s for s, t in timed),
        "step_seconds": [s for s, _ in steps],
    }


def trl_arguments(spec: dict) -> dict[str, Any]:
    """The TRL config keys every mode shares (TRL's ``SFTConfig``, ``DPOConfig``): one epoch, float32 on the CPU,
    ``spec["batch_size"]`` examples a forward and ``spec.get("accumulate", 1)`` forwards a step."""
    return {
        "output_dir": spec["workdir"], "num_train_epochs": 1, "per_device_train_batch_size": spec["batch_size"],
        "gradient_accumulation_steps": spec.get("accumulate", 1), "learning_rate": LR, "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0, "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True,
        "bf16": False, "seed": spec["seed"], "dataloader_num_workers": 0, "disable_tqdm": True,
    }  # fmt: skip


def trl_rows(spec: dict):
    """The data file as a ``datasets.Dataset``, its cache in the bench's scratch directory."""
    import datasets

    return datasets.load_dataset(
        "json", data_files=spec["data"], split="train", cache_dir=str(Path(spec["workdir"]) / "datasets")
    )


def timed_training(trainer_class: type, config: Any, spec: dict) -> dict:
    """Train TRL's ``trainer_class`` with ``config`` over one epoch of ``spec``'s rows, on its model in float32
    (torch seeded by ``spec["seed"]`` first), and return its figures: a forward's positions are its ``input_ids``'
    size, its tokens the attention mask's sum (a padding-free batch has none: every position is a token); a step is
    timed from its first forward to the end of its optimizer step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    counts = {"positions": 0, "tokens": 0, "step_tokens": 0}
    step_times: list[tuple[float, int]] = []

    class Counting(trainer_class):
        def training_step(self, model, inputs, *args, **kwargs):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            counts["positions"] += ids.numel()
            counts["step_tokens"] += ids.numel() if mask is None else int(mask.sum())
            return super().training_step(model, inputs, *args, **kwargs)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began, counts["step_tokens"] = time.perf_counter(), 0

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append((time.perf_counter() - self.began, counts["step_tokens"]))
            counts["tokens"] += counts["step_tokens"]

    trainer = Counting(
        model=model, args=config, train_dataset=trl_rows(spec), processing_class=tokenizer, callbacks=[Timer()]
    )
    trainer.train()
    return {
        "mode": spec["mode"],
        "steps": len(step_times),
        "examples_per_forward": spec["batch_size"],
        "forwards_per_step": spec.get("accumulate", 1),
        "tokens": counts["tokens"],
        "positions_computed": counts["positions"],
        **step_figures(step_times),
        "precision": "float32",
        "padding_free": bool(trainer.padding_free),
    }


def run_trl(verb: str, spec: dict, workdir: Path) -> dict:
    """One TRL mode in its own process (``relayrl bench <verb> --side``): its figures."""
    path = workdir / f"trl-{spec['mode']}.json"
    path.write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "relayrl.cli", "bench", verb, "--side", str(path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL {spec['mode']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_bench(versus: Versus, args: argparse.Namespace, argv: list[str] | None) -> int:
    """The bench of ``args`` (module docstring); prints the JSON and writes it to ``--out``."""
    if args.side:
        spec = json.loads(Path(args.side).read_text())
        if spec["threads"]:
            import torch

            torch.set_num_threads(spec["threads"])
        print(json.dumps(versus.trl_side(spec)))
        return 0
    from relayrl.config import SFTConfig
    from relayrl.models.assets import prepare_model

    cfg = SFTConfig.model_validate({"model": {"path": args.model}, "data": {"path": "-"}})
    prepare_model(cfg)  # a builtin: built once per machine, both sides read the same directory
    machine = machine_record({"relayrl": {"precision": "float32"}, "trl": {"precision": "float32"}})
    with scratch(f"relayrl-bench-{versus.verb}-") as workdir:
        data = workdir / "rows.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in versus.rows(args)))
        spec = {
            "model": cfg.model.path, "data": str(data), "seed": args.seed, "batch_tokens": args.batch_tokens,
            "pack_tokens": args.pack_tokens, "threads": args.threads,
        }  # fmt: skip
        relayrl = relayrl_side(versus, spec, workdir)
        trl = {}
        for mode, extra in versus.trl_modes(relayrl).items():
            side = {**spec, "mode": mode, "workdir": str(workdir / f"trl-{mode}"), **extra}
            trl[mode] = run_trl(versus.verb, side, workdir)
        result = {
            "bench": f"{versus.verb}-vs-trl",
            "command": " ".join([f"relayrl bench {versus.verb}", *(sys.argv[3:] if argv is None else argv)]),
            "model": args.model,
            "data": {"examples": args.examples, "words": [args.min_words, args.max_words], "seed": args.seed},
            "batch_tokens": args.batch_tokens,
            "pack_tokens": args.pack_tokens,
            "threads": args.threads,
            "machine": machine,
            "relayrl": relayrl,
            "trl": trl,
            "speedup": {mode: relayrl["tokens_per_s"] / side["tokens_per_s"] for mode, side in trl.items()},
            "speedup_median": {
                mode: relayrl["median_step_tokens_per_s"] / side["median_step_tokens_per_s"]
                for mode, side in trl.items()
            },
            "positions_per_token": {
                "relayrl": relayrl["positions_computed"] / relayrl["tokens"],
                **{mode: side["positions_computed"] / side["tokens"] for mode, side in trl.items()},
            },
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
