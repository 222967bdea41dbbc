"""``relayrl bench dpo``: ``relayrl train dpo`` against TRL's ``DPOTrainer`` on the same model, preference pairs,
pairs a step and lengths, in one run, each side its own process (issue 47, item 5; the shared part:
relayrl/bench/versus_trl.py).

The data: ``--examples`` plain-text preference rows (TRL's ``prompt``/``chosen``/``rejected``; both sides append the
EOS token to each completion) whose three texts each have a long-tailed length (``preference_rows``). The loss on
every side: sigmoid DPO, β 0.1, the reference log-probs computed once before training (relayrl ``loss.reference:
precomputed``, TRL ``precompute_ref_log_probs=True``: no reference forward in any timed step, TRL's fastest setting
and relayrl's default). A pair forwards two sequences, prompt + chosen and prompt + rejected; its tokens are both
sequences'. One epoch each side:

- relayrl: ``trainer.batch_tokens`` tokens a step, the pairs' sequences packed into rows of at most
  ``trainer.pack_tokens`` (back to back, positions restarting, no attention across them);
- TRL ``padded``: ``per_device_train_batch_size`` = the pairs relayrl's steps hold on average, its 2 × pairs
  sequences padded to the longest (TRL's default);
- TRL ``per-pair``: one pair a forward (padding only between its chosen and rejected sequence), as many forwards a
  step by gradient accumulation. TRL 1.16 has no padding-free DPO (``padding_free=True`` warns and pads), so these
  two are the choices it leaves: fewer forwards or less padding.
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

BETA = 0.1


def preference_rows(count: int, min_words: int, max_words: int, seed: int) -> list[dict]:
    """``count`` rows ``{"prompt", "chosen", "rejected"}``, each text of min_words..max_words words
    (``long_tailed_text``); a completion starts with a space, as it follows its prompt."""
    rng = random.Random(seed)
    return [
        {
            "prompt": long_tailed_text(rng, min_words, max_words),
            "chosen": " " + long_tailed_text(rng, min_words, max_words),
            "rejected": " " + long_tailed_text(rng, min_words, max_words),
        }
        for _ in range(count)
    ]


def trl_modes(relayrl: dict) -> dict[str, dict]:
    """As many pairs a step as relayrl's steps hold on average: in one forward (padded) or one a forward."""
    pairs = max(1, round(relayrl["examples_per_step"]))
    return {"padded": {"batch_size": pairs}, "per-pair": {"batch_size": 1, "accumulate": pairs}}


def trl_side(spec: dict) -> dict:
    """TRL's DPOTrainer over one epoch in ``spec["mode"]``; run in its own process (``--side``)."""
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        **trl_arguments(spec), loss_type=["sigmoid"], beta=BETA, precompute_ref_log_probs=True, max_length=None,
    )  # fmt: skip
    return timed_training(DPOTrainer, config, spec)


def rows(args: argparse.Namespace) -> list[dict]:
    return preference_rows(args.examples, args.min_words, args.max_words, args.seed)


DPO = Versus(
    verb="dpo",
    rows=rows,
    trl_modes=trl_modes,
    trl_side=trl_side,
    relayrl_sections={"loss": {"type": "sigmoid", "beta": BETA, "reference": "precomputed"}},
)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("relayrl bench dpo", __doc__.splitlines()[0], examples=48, max_words=150)
    return run_bench(DPO, parser.parse_args(argv), argv)
