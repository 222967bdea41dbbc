"""``relayrl bench prefix``: prompts that begin alike, prefilled with their common beginning once (the hf engine's
default, relayrl/rollout/batcher.py) against each prompt in full (``rollout.prefix_cache_tokens=0``).

The prompts are the first ``--prompts`` of ``--config``'s held-out set ``heldout``, rendered as the eval renders
them, after a system turn of ``--system-words`` words (``data.system_prompt``: a long system prompt or tool list;
0 keeps the config's rendering, e.g. SmolLM2's chat template's own system turn). Each round sends them in one call of
one greedy token each (so the call is their prefill) to two hf engines built as ``relayrl rollout serve`` builds
them, one with the config's prefix cache and one without it, which goes first alternating by round; the sharing
engine's store is flushed before each call (``weights_changed``), so no round reuses the last one's KV. The JSON has
each side's seconds per round and their median, the ratio (full / shared), the prompt tokens each prefilled and
reused, and for how many prompts the two sides' greedy tokens differ (the float32 logprobs of the two paths agree
within 1e-5, tests/unit/test_engine_families.py; in bf16 the two forwards round differently and a near-tie may flip).
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
    p.add_argument("--rounds", type=positive_int, default=5, help="calls to each engine")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    if args.system_words < 0:
        p.error(f"--system-words: 0 or more, got {args.system_words}")
    return args


def system_turn(words: int) -> list[str]:
    """The override that puts a system turn of ``words`` words before every prompt (none for 0)."""
    return [f"data.system_prompt={' '.join(RULE[i % len(RULE)] for i in range(words))}"] if words else []


def engines(cfg, dtype: str) -> dict:
    """side -> an hf engine as the worker builds it: ``shared`` with the config's prefix cache, ``full`` without."""
    import torch

    from relayrl.cores.threads import torch_threads
    from relayrl.rollout.hf import HFEngine
    from relayrl.services.rollout_server import hf_engine_options

    torch.set_num_threads(1)  # as the worker: only the engine's scheduler thread computes multithreaded
    options = hf_engine_options(cfg, torch_threads(cfg, "rollout"))
    return {
        side: HFEngine(
            cfg.model.path,
            dtype=dtype,
            max_batch_size=cfg.rollout.max_batch_size,
            **{**options, "prefix_cache_tokens": budget},
        )
        for side, budget in (("shared", cfg.rollout.prefix_cache_tokens), ("full", 0))
    }


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
    sides = engines(cfg, dtype)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    answers, counts = {}, {}
    for round_ in range(args.rounds):
        for side in sorted(sides, reverse=round_ % 2 == 1):
            took, answers[side], counts[side] = timed_call(sides[side], prompts)
            seconds[side].append(took)
    for engine in sides.values():
        engine.close()
    machine["loadavg_at_end"] = list(os.getloadavg())
    median = {side: statistics.median(values) for side, values in seconds.items()}
    result = {
        "bench": "prefix",
        "command": f"relayrl bench prefix --config {os.path.relpath(args.config, ROOT)} --prompts {args.prompts} "
        f"--system-words {args.system_words} --rounds {args.rounds}" + "".join(f" --set {s}" for s in args.overrides),
        "prompt_tokens": [len(p) for p in prompts],
        "machine": machine,
        **{
            side: {
                "seconds": seconds[side],
                "median_s": median[side],
                "prefilled": counts[side][0],
                "reused": counts[side][1],
            }
            for side in sides
        },
        "full_over_shared": median["full"] / median["shared"],
        "differing_tokens": sum(a != b for a, b in zip(answers["shared"], answers["full"], strict=True)),
    }
    return write(result, args.out)
