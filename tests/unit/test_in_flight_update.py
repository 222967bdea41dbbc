"""In-flight weight updates in the hf engine (``rollout.partial``): rows frozen at a step boundary continue on the
new weights, re-prefilled (recompute) or on their kept KV (keep_kv), never restarted, and every token carries the
version that sampled it."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_testing import sharp_tiny_model
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.wire.sampling import GenerationLimits, SamplingParams

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13]]
LONG = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=11)
PAUSE_AT = 4  # the pause lands after at most this many scheduler steps of the long request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


def new_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {name: t + 0.5 * torch.randn(t.shape, generator=generator) for name, t in engine.named_weights()}


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    return logprobs_from_logits(model(input_ids=ids).logits[0, len(prompt) - 1 : -1], torch.tensor(response))


def generate_across_an_update(engine: HFEngine, weights: dict[str, torch.Tensor]):
    """A short request and a long one; once the short one is done the long one is frozen (after at most PAUSE_AT
    steps: the scheduler is held there until the pause is asked), the weights change, it resumes as version 7.
    Returns (the short request's completions, the long one's)."""
    steps, paused = 0, threading.Event()

    def hold_at_pause() -> bool:  # called by the scheduler once a step: holds it until the pause is asked
        nonlocal steps
        steps += 1
        if steps == PAUSE_AT:
            paused.wait()
        return False

    results: dict[str, list] = {}
    long = threading.Thread(target=lambda: results.update(long=list(engine.generate(PROMPTS, LONG, hold_at_pause))))
    long.start()
    short = list(engine.generate([[14]], SamplingParams(n=1, max_tokens=2, ignore_eos=True)))
    pausing = threading.Thread(target=engine.pause_in_flight)
    pausing.start()
    while not engine._batcher._pausing:  # the pause is asked before the scheduler may take its next step
        threading.Event().wait(0.001)
    paused.set()
    pausing.join()  # parked between two steps
    engine.load_weights(weights.items())
    engine.resume_in_flight(7)
    long.join()
    return short, results["long"]


@pytest.mark.parametrize("partial", ["recompute", "keep_kv"])
def test_rows_in_flight_continue_on_the_new_weights(model_dir, partial) -> None:
    engine = HFEngine(str(model_dir), partial=partial)
    old_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    weights = new_weights(engine)
    try:
        short, long = generate_across_an_update(engine, weights)
    finally:
        engine.close()
    new_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new_model.load_state_dict(weights, strict=False)

    assert short[0].token_versions is None  # finished before the update: all by the call's version
    assert sorted((c.prompt_index, c.sample_index) for c in long) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in long:
        assert c.finish_reason == "length" and len(c.token_ids) == LONG.max_tokens  # not restarted, not aborted
        old = c.token_versions.count(0)  # sampled before the update (keep_kv: and the one from the kept logits)
        assert 1 <= old <= PAUSE_AT + 1 and c.token_versions == [0] * old + [7] * (LONG.max_tokens - old)
        prompt = PROMPTS[c.prompt_index]
        before = full_forward_logprobs(old_model, prompt, c.token_ids)[:old]
        torch.testing.assert_close(torch.tensor(c.logprobs[:old]), before, atol=1e-4, rtol=0)
        after = full_forward_logprobs(new_model, prompt, c.token_ids)[old:]
        gap = (torch.tensor(c.logprobs[old:]) - after).abs().max()
        if partial == "recompute":  # the rows' KV was computed again on the new weights: exactly its logprobs
            assert gap < 1e-4
        else:  # the kept KV is the old weights': the new tokens' logprobs are not a fresh forward's
            assert gap > 1e-3
    assert engine._batcher.recomputed_rows == (4 if partial == "recompute" else 0)


def test_a_worker_refuses_partial_on_an_engine_that_cannot() -> None:
    engine = SimpleNamespace(name="stub", supports_in_flight_update=False)
    with pytest.raises(ValueError, match=r"rollout.partial \(keep_kv\): the stub engine cannot"):
        RolloutWorker(engine, "w", mode="pause", limits=GenerationLimits(), partial="keep_kv")
