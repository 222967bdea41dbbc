"""``relayrl bench prefix``: prompts that begin alike on the hf engine, their common beginning prefilled once
(relayrl/rollout/batcher.py, from ``--min-shared`` tokens) against each prompt in full (sharing off).

The prompts are the first ``--prompts`` of ``--config``'s held-out set ``heldout``, rendered as the eval renders
them, after a system turn of ``--system-words`` words (``data.system_prompt``: a long system prompt or tool list;
0 keeps the config's rendering, e.g. SmolLM2's chat template's own system turn). Each side builds an hf engine as
``relayrl rollout serve`` builds it (prefix cache included), makes one untimed call, then ``--rounds`` timed calls of
one greedy token a prompt (so a call is their prefill), each on a flushed store (``weights_changed``), and closes it
before the other side starts: one engine at a time, since two engines' threads in one process slow each other. The
sides differ only in the engine's ``min_shared_beginning``: ``--min-shared`` for ``shared``, more than any prompt for
``full``. The JSON has each side's seconds per call and their median, the ratio
(full / shared), the prompt tokens each prefilled and reused, and for how many prompts the two sides' greedy tokens
differ (the float32 logprobs of the two paths agree within 1e-5, tests/unit/test_engine_families.py; in bf16 the
two forwards round differently and a near-tie may flip).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from relayrl.bench.humaneval import set_prompts, write
from relayrl.bench.record import ROOT, machine_record
from relayrl.config import load_config
from relayrl.ops.args import positive_int
from relayrl.runtime.precision import engine_dtype_name

CONFIG = ROOT / "examples" / "addition-smollm2.yaml"
EVAL_SET = "heldout"
# the system turn's words, repeated
RULE = ("answer", "with", "the", "sum", "of", "the", "two", "numbers", "and", "nothing", "else")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relayrl bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="the relayrl config (its held-out set heldout)")
    p.add_argument("--prompts", type=positive_int, default=8, help="held-out prompts, one call")
    p.add_argument("--system-words", type=int, default=400, help="words of the system turn (0: the config's own)")
    p.add_argument("--rounds", type=positive_int, default=5, help="timed calls of each side")
    p.add_argument("--min-shared", type=positive_int, default=None, help="tokens the shared side shares from "
                   "(default: the engine's MIN_SHARED_BEGINNING)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    if args.min_shared is None:
        from relayrl.rollout.batcher import MIN_SHARED_BEGINNING

        args.min_shared = MIN_SHARED_BEGINNING
    if args.system_words < 0:
        p.error(f"--system-words: 0 or more, got {args.system_words}")
    return args


def system_turn(words: int) -> list[str]:
    """The override that puts a system turn of ``words`` words before every prompt (none for 0)."""
    return [f"data.system_prompt={' '.join(RULE[i % len(RULE)] for i in range(words))}"] if words else []


def side_calls(cfg, dtype: str, prompts: list[list[int]], min_shared: int, rounds: int) -> list:
    """``timed_call``'s result for each of ``rounds`` calls on an hf engine built as the worker builds it, sharing
    common beginnings from ``min_shared`` tokens, after one untimed call."""
    import torch

    from relayrl.cores.threads import torch_threads
    from relayrl.rollout.hf import HFEngine
    from relayrl.services.rollout_server import hf_engine_options

    torch.set_num_threads(1)  # as the worker: only the engine's scheduler thread computes multithreaded
    options = hf_engine_options(cfg, torch_threads(cfg, "rollout"))
    engine = HFEngine(
        cfg.model.path, dtype=dtype, max_batch_size=cfg.rollout.max_batch_size, min_shared_beginning=min_shared,
        **options,
    )  # fmt: skip
    try:
        timed_call(engine, prompts)
        return [timed_call(engine, prompts) for _ in range(rounds)]
    finally:
        engine.close()


def timed_call(engine, prompts: list[list[int]]) -> tuple[float, list[int], tuple[int, int]]:
    """Seconds of one call (one greedy token a prompt) on a flushed store, its tokens, and the prompt tokens it
    prefilled and reused."""
    from relayrl.wire.sampling import SamplingParams

    engine.weights_changed()
    before = engine.prefill_counts()
    start = time.perf_counter()
    done = sorted(engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1)), key=lambda c: c.prompt_index)
    seconds = time.perf_counter() - start
    after = engine.prefill_counts()
    return seconds, [c.token_ids[0] for c in done], (after.computed - before.computed, after.reused - before.reused)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, *system_turn(args.system_words)])
    dtype = engine_dtype_name(cfg.rollout.weight_dtype, cfg.trainer.precision, "cpu")
    machine = machine_record({"relayrl": {"precision": dtype, "attn_implementation": None}})
    prompts = set_prompts(cfg, args.prompts, EVAL_SET)
    thresholds = {"shared": args.min_shared, "full": max(map(len, prompts)) + 1}
    calls = {side: side_calls(cfg, dtype, prompts, min_shared, args.rounds) for side, min_shared in thresholds.items()}
    seconds = {side: [took for took, _, _ in done] for side, done in calls.items()}
    answers = {side: done[-1][1] for side, done in calls.items()}
    counts = {side: done[-1][2] for side, done in calls.items()}
    machine["loadavg_at_end"] = list(os.getloadavg())
    median = {side: statistics.median(values) for side, values in seconds.items()}
    result = {
        "bench": "prefix",
        "command": f"relayrl bench prefix --config {os.path.relpath(args.config, ROOT)} --prompts {args.prompts} "
        f"--system-words {args.system_words} --min-shared {args.min_shared} --rounds {args.rounds}"
        + "".join(f" --set {s}" for s in args.overrides),
        "prompt_tokens": [len(p) for p in prompts],
        "machine": machine,
        **{
            side: {
                "seconds": seconds[side],
                "median_s": median[side],
                "prefilled": counts[side][0],
                "reused": counts[side][1],
            }
            for side in thresholds
        },
        "full_over_shared": median["full"] / median["shared"],
        "differing_tokens": sum(a != b for a, b in zip(answers["shared"], answers["full"], strict=True)),
    }
    return write(result, args.out)
