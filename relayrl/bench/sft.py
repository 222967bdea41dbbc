"""``relayrl bench sft``: ``relayrl train sft`` against TRL's ``SFTTrainer`` on the same model, data, step size and
row length, in one run, each side its own process (issue 47, item 5; the shared part: relayrl/bench/versus_trl.py).

The data: ``--examples`` plain-text rows (TRL's language-modeling format: the loss reads every token, the same on
both sides) of long-tailed lengths (``text_rows``). One epoch over them on each side:

- relayrl: ``trainer.batch_tokens`` tokens a step, packed into rows of at most ``trainer.pack_tokens`` (examples back
  to back, positions restarting, no attention across them);
- TRL ``padded``: ``per_device_train_batch_size`` = the examples relayrl's steps hold on average, each batch padded
  to its longest example (TRL's default);
- TRL ``packed``: ``packing=True`` (best-fit decreasing, which turns on TRL's padding-free collator) with
  ``max_length`` = pack_tokens and as many rows a step as relayrl's steps have on average: TRL's fastest setting
  on a CPU (its padding-free rows go through the model's SDPA with position ids, as relayrl's).

The ratio of relayrl's tokens/s to each TRL side's is then mostly positions computed per token (padding) and
per-step overhead.
"""

from __future__ import annotations

import argparse
import random

from relayrl.bench.versus_trl import (
    Versus,
    bench_arguments,
    long_tailed_text,
    run_bench,
    timed_training,
    trl_arguments,
)


def text_rows(count: int, min_words: int, max_words: int, seed: int) -> list[dict]:
    """``count`` rows ``{"text": ...}`` of min_words..max_words words (``long_tailed_text``)."""
    rng = random.Random(seed)
    return [{"text": long_tailed_text(rng, min_words, max_words)} for _ in range(count)]


def trl_modes(relayrl: dict) -> dict[str, dict]:
    """Padded: as many examples a step as relayrl's steps hold; packed: as many rows."""
    return {
        "padded": {"batch_size": round(relayrl["examples_per_step"])},
        "packed": {"batch_size": max(1, round(relayrl["rows_per_step"]))},
    }


def trl_side(spec: dict) -> dict:
    """TRL's SFTTrainer over one epoch in ``spec["mode"]``; run in its own process (``--side``)."""
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**trl_arguments(spec), packing=spec["mode"] == "packed", max_length=spec["pack_tokens"])
    return timed_training(SFTTrainer, config, spec)


def rows(args: argparse.Namespace) -> list[dict]:
    return text_rows(args.examples, args.min_words, args.max_words, args.seed)


SFT = Versus(verb="sft", rows=rows, trl_modes=trl_modes, trl_side=trl_side, relayrl_sections={})


def main(argv: list[str] | None = None) -> int:
    # 64 rows of 8-200 words: 10 steps of 512 tokens under SmolLM2's tokenizer, 9 of them timed (>= 8: per-step noise)
    parser = bench_arguments(
        "relayrl bench sft", __doc__.splitlines()[0], examples=64, max_words=200, batch_tokens=512, pack_tokens=512
    )
    return run_bench(SFT, parser.parse_args(argv), argv)
