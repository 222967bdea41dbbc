"""``relayrl bench sft``: ``relayrl train sft`` against TRL's ``SFTTrainer`` on the same model, data, step size and
row length, in one run, each side its own process (issue 47, item 5).

The data: ``--examples`` plain-text rows (TRL's language-modeling format: the loss reads every token, the same on
both sides) of long-tailed lengths, ``--min-words`` to ``--max-words`` words, written by a program (``text_rows``).
One epoch over them on each side, float32, AdamW at a constant lr, gradient clipping 1.0:

- relayrl: ``trainer.batch_tokens`` tokens a step, packed into rows of at most ``trainer.pack_tokens`` (examples back
  to back, positions restarting, no attention across them);
- TRL ``padded``: ``per_device_train_batch_size`` = the examples relayrl's steps hold on average, each batch padded
  to its longest example (TRL's default);
- TRL ``packed``: ``packing=True`` (best-fit decreasing, which turns on TRL's padding-free collator) with
  ``max_length`` = pack_tokens and as many rows a step as relayrl's steps have on average: TRL's fastest setting
  on a CPU (its padding-free rows go through the model's SDPA with position ids, as relayrl's).

Figures per side: the example tokens trained (the rows' own tokens: the same count on every side), the positions
computed (padding included), the seconds of the optimizer steps (each step from its first forward to the end of its
optimizer step, summed; the first step left out as warm-up on every side) and tokens/s = the tokens of the steps
timed / their seconds. The ratio of relayrl's tokens/s to each TRL side's is then mostly positions computed per
token (padding) and per-step overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relayrl.bench.example_run import ROOT
from relayrl.bench.record import machine_record

TRL_MODES = ("padded", "packed")
WORDS = [  # the text rows' words
    "the",
    "river",
    "runs",
    "past",
    "an",
    "old",
    "mill",
    "where",
    "children",
    "learn",
    "to",
    "count",
    "stones",
    "and",
    "birds",
    "while",
    "the",
    "wind",
    "turns",
    "every",
    "page",
    "of",
    "a",
    "long",
    "story",
    "about",
    "seven",
    "small",
    "boats",
    "that",
    "sail",
    "home",
    "before",
    "dark",
]


def text_rows(count: int, min_words: int, max_words: int, seed: int) -> list[dict]:
    """``count`` rows ``{"text": ...}`` of min_words..max_words words, the length drawn log-uniformly (many short
    rows, a few long ones: the shape of chat data)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = round(min_words * (max_words / min_words) ** rng.random())
        rows.append({"text": " ".join(rng.choice(WORDS) for _ in range(words)) + "."})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench sft", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model.path of both sides")
    p.add_argument("--examples", type=int, default=96)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens a step (relayrl trainer.batch_tokens)")
    p.add_argument("--pack-tokens", type=int, default=1024, help="row length (relayrl pack_tokens, TRL max_length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here (default: stdout only)")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one TRL side from a spec file
    return p.parse_args(argv)


def relayrl_side(spec: dict, workdir: Path) -> dict:
    """``relayrl train sft`` over one epoch; its figures from metrics.jsonl."""
    config = {
        "run": {"name": "bench-sft", "dir": str(workdir / "runs"), "seed": spec["seed"]},
        "model": {"path": spec["model"]},
        "data": {"path": spec["data"], "shuffle": True},
        "trainer": {
            "epochs": 1, "batch_tokens": spec["batch_tokens"], "pack_tokens": spec["pack_tokens"], "lr": 2e-5,
            "lr_schedule": "constant", "precision": "float32", "export_hf": False,
        },
    }  # fmt: skip
    path = workdir / "sft.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "relayrl.cli", "train", "sft", str(path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"relayrl train sft failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (workdir / "runs" / "bench-sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    timed = steps[1:]
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["step_seconds"] for r in timed)
    return {
        "steps": len(steps),
        "examples_per_step": sum(r["examples"] for r in steps) / len(steps),
        "rows_per_step": sum(r["rows"] for r in steps) / len(steps),
        "tokens": sum(r["tokens"] for r in steps),
        "positions_computed": sum(r["tokens"] for r in steps),  # packed rows hold no padding
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "precision": "float32",
    }


def trl_side(spec: dict) -> dict:
    """TRL's SFTTrainer over one epoch in ``spec["mode"]``; run in its own process (``--side``)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(spec["seed"])
    packed = spec["mode"] == "packed"
    counts = {"positions": 0, "tokens": 0, "step_tokens": 0}
    step_times: list[tuple[float, int]] = []

    class Counting(SFTTrainer):
        """SFTTrainer counting the positions each forward computes and the example tokens among them."""

        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs["input_ids"]
            counts["positions"] += ids.numel()
            counts["step_tokens"] += ids.numel() if packed else int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began, counts["step_tokens"] = time.perf_counter(), 0

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append((time.perf_counter() - self.began, counts["step_tokens"]))
            counts["tokens"] += counts["step_tokens"]

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = SFTConfig(
        output_dir=spec["workdir"], num_train_epochs=1, per_device_train_batch_size=spec["batch_size"],
        learning_rate=2e-5, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, seed=spec["seed"], packing=packed, max_length=spec["pack_tokens"],
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Counting(
        model=model, args=config, train_dataset=datasets.load_dataset("json", data_files=spec["data"], split="train"),
        processing_class=tokenizer, callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    timed = step_times[1:]
    tokens, seconds = sum(t for _, t in timed), sum(s for s, _ in timed)
    return {
        "mode": spec["mode"],
        "steps": len(step_times),
        "rows_per_step": spec["batch_size"],
        "tokens": counts["tokens"],
        "positions_computed": counts["positions"],
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "precision": "float32",
        "padding_free": bool(trainer.padding_free),
    }


def run_trl(spec: dict, workdir: Path) -> dict:
    path = workdir / f"trl-{spec['mode']}.json"
    path.write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "relayrl.cli", "bench", "sft", "--side", str(path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL {spec['mode']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        print(json.dumps(trl_side(json.loads(Path(args.side).read_text()))))
        return 0
    from relayrl.config import SFTConfig
    from relayrl.models.assets import prepare_model

    cfg = SFTConfig.model_validate({"model": {"path": args.model}, "data": {"path": "-"}})
    prepare_model(cfg)  # a builtin: built once per machine, both sides read the same directory
    machine = machine_record({"relayrl": {"precision": "float32"}, "trl": {"precision": "float32"}})
    workdir = Path(tempfile.mkdtemp(prefix="relayrl-bench-sft-"))
    try:
        data = workdir / "rows.jsonl"
        rows = text_rows(args.examples, args.min_words, args.max_words, args.seed)
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        spec = {
            "model": cfg.model.path, "data": str(data), "seed": args.seed, "batch_tokens": args.batch_tokens,
            "pack_tokens": args.pack_tokens,
        }  # fmt: skip
        relayrl = relayrl_side(spec, workdir)
        sizes = {"padded": round(relayrl["examples_per_step"]), "packed": max(1, round(relayrl["rows_per_step"]))}
        trl = {
            mode: run_trl(
                {**spec, "mode": mode, "workdir": str(workdir / f"trl-{mode}"), "batch_size": sizes[mode]}, workdir
            )
            for mode in TRL_MODES
        }
        result = {
            "bench": "sft-vs-trl",
            "command": " ".join(["relayrl bench sft", *(sys.argv[3:] if argv is None else argv)]),
            "model": args.model,
            "data": {"examples": args.examples, "words": [args.min_words, args.max_words], "seed": args.seed},
            "batch_tokens": args.batch_tokens,
            "pack_tokens": args.pack_tokens,
            "machine": machine,
            "relayrl": relayrl,
            "trl": trl,
            "speedup": {mode: relayrl["tokens_per_s"] / side["tokens_per_s"] for mode, side in trl.items()},
            "positions_per_token": {
                "relayrl": relayrl["positions_computed"] / relayrl["tokens"],
                **{mode: side["positions_computed"] / side["tokens"] for mode, side in trl.items()},
            },
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
