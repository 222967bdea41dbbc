"""The engine side of the model-family matrix (relayrl/models/families.py, ENGINE_PATHS): on every family's tiny
model the hf engine's logprobs of the tokens it samples equal the trainer's (a plain forward of prompt + response,
the model loaded as the trainer loads it) within 1e-5 in float32: on the fast decoder where the family's claim says
exact, on the transformers forward where it says falls back (and the engine's log says why, in the claim's words),
with rows of concurrent calls joining, leaving and padded together, with the prefix cache, and with prompts that
share their beginning. Sequences run past the windowed families' sliding window (families.WINDOW)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_hf_engine import by_key, generate_in_threads, recompute_logprobs
from transformers import AutoModelForCausalLM

from relayrl.models.families import FAMILIES, WINDOW, claim, write_family_model
from relayrl.rollout.batcher import MIN_SHARED_BEGINNING
from relayrl.rollout.hf import HFEngine
from relayrl.runtime.attention import resolved
from relayrl.wire.sampling import SamplingParams

EXACT = 1e-5
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14], [15]]
# four calls joining one running batch at different steps: prompt lengths, temperatures, top-p, n differ; EOS ends
# some rows early; every sequence of the last call runs 16 tokens past its prompt
CALLS = [
    ([PROMPTS[0], PROMPTS[2]], SamplingParams(n=2, temperature=1.0, max_tokens=14, seed=1)),
    ([PROMPTS[1]], SamplingParams(n=3, temperature=0.7, top_p=0.9, max_tokens=9, seed=2)),
    ([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3, 4]], SamplingParams(n=1, temperature=0, max_tokens=6)),
    ([PROMPTS[2], PROMPTS[1]], SamplingParams(n=2, temperature=1.3, max_tokens=16, ignore_eos=True, seed=3)),
]
# an episode per row, three turns: what the environment answers after turns 1 and 2 differs in length per episode,
# so rows continuing cached prefixes carry suffixes of different lengths in one prefill
EPISODES = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
OBSERVATIONS = [[[17, 18, 19], [20]], [[21, 22], [3, 4, 5, 6, 7]]]
TURN = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family's tiny model with its matrices x4: sharp logits and attention far from uniform, so that a wrong
    mask, window or position would move logprobs well past the tolerance."""
    path = write_family_model(family, tmp_path_factory.mktemp(family))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for weight in model.parameters():
            weight.mul_(4.0 if weight.ndim == 2 else 1.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> torch.nn.Module:
    """The model as the trainer loads it (model.attn_implementation auto: the model's own attention)."""
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def worst_gap(trainer: torch.nn.Module, prompts: list[list[int]], completions, temperature: float) -> float:
    """The largest |engine - trainer| logprob over every sampled token."""
    gaps = [
        (torch.tensor(c.logprobs) - torch.tensor(recompute_logprobs(trainer, prompts[c.prompt_index], c.token_ids, t)))
        .abs()
        .max()
        for c in completions
        if c.token_ids
        for t in [temperature or 1.0]
    ]
    return float(max(gaps))


def test_engine_logprobs_equal_the_trainers_on_the_declared_decoder(family, model_dir, trainer, caplog) -> None:
    declared = claim(family, "hf_fast_decoder")
    with caplog.at_level(logging.INFO, logger="relayrl.rollout.hf"):
        engine = HFEngine(str(model_dir), max_batch_size=64)
    assert engine.decoder == ("fast" if declared.status == "exact" else "transformers")
    if declared.status != "exact":
        assert f"the fast runner does not support it: {declared.reason}" in caplog.text
    assert resolved(engine.model) == resolved(trainer)  # the same attention on both sides
    results = generate_in_threads(engine, CALLS, delays=[0.0, 0.01, 0.03, 0.05])
    assert engine._batcher.peak_requests >= 2, "rows of different calls were never decoded together"
    engine.close()
    assert max(len(p) + 16 for p in CALLS[3][0]) > WINDOW
    for (prompts, params), completions in zip(CALLS, results, strict=True):
        assert set(by_key(completions)) == {(p, s) for p in range(len(prompts)) for s in range(params.n)}
        assert worst_gap(trainer, prompts, completions, params.temperature) <= EXACT


def test_prefix_cache_turns_equal_the_trainers(family, model_dir, trainer) -> None:
    assert claim(family, "hf_prefix_cache").status == "exact"
    engine = HFEngine(str(model_dir), max_batch_size=8)
    conversations = [list(p) for p in EPISODES]
    for number in range(3):
        before = engine.prefill_counts().reused
        completions = sorted(engine.generate(conversations, TURN), key=lambda c: c.prompt_index)
        assert (engine.prefill_counts().reused > before) == (number > 0)
        assert worst_gap(trainer, conversations, completions, TURN.temperature) <= EXACT
        for episode, (conversation, completion) in enumerate(zip(conversations, completions, strict=True)):
            conversation += completion.token_ids + (OBSERVATIONS[number][episode] if number < 2 else [])
    assert min(map(len, conversations)) > WINDOW
    engine.close()


def test_prompts_that_begin_alike_equal_the_trainers(family, model_dir, trainer) -> None:
    """Prompts of one call with a common beginning longer than the sliding window: it is prefilled once, each
    prompt's rest on its KV."""
    beginning = [3 + i % 19 for i in range(MIN_SHARED_BEGINNING)]
    prompts = [[*beginning, 5, 6], [*beginning, 7], [*beginning, 8, 9, 10]]
    engine = HFEngine(str(model_dir), max_batch_size=8)
    completions = list(engine.generate(prompts, TURN))
    assert engine.prefill_counts().reused == len(prompts) * len(beginning)
    assert worst_gap(trainer, prompts, completions, TURN.temperature) <= EXACT
    assert len(beginning) > WINDOW
    engine.close()
