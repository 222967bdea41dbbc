"""The hf engine's prefix KV cache (relayrl/rollout/prefix_cache.py): an episode's later turns prefill only their
new tokens, with the logprobs of a full prefill, on both runners, and prompts that join together prefill their
common beginning once; every weight change flushes it; the budget evicts the least recently used entries."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from engine_testing import new_weights, recompute, sharp_tiny_model, sync_manifest

from relayrl.rollout.batcher import MIN_SHARED_BEGINNING
from relayrl.rollout.engine import EngineCompletion
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.prefix_cache import CachedPrefix, PrefixCache
from relayrl.rollout.worker import RolloutWorker
from relayrl.runtime.sequences import shared_beginning
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import GenerationLimits, SamplingParams

EXACT = 1e-5  # |cached-prefix logprob - full-prefill logprob| in float32: rounding only
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
EPISODES = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]  # first turns of two episodes
# what the environment answers each episode after turns 1 and 2 (rendered ids): lengths differ, so rows joining
# together continue prefixes of different lengths with suffixes of different lengths
OBSERVATIONS = [[[17, 18, 19], [20]], [[21, 22], [3, 4, 5, 6, 7]]]
RUNNERS = pytest.mark.parametrize("decode", ["fast", "transformers"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


def turn(engine: HFEngine, prompts: list[list[int]]) -> tuple[list[EngineCompletion], int, int]:
    """One generate call (the completions in prompt order) and the prompt tokens it prefilled and reused."""
    before = engine.prefill_counts()
    out = sorted(engine.generate(prompts, PARAMS), key=lambda c: c.prompt_index)
    after = engine.prefill_counts()
    return out, after.computed - before.computed, after.reused - before.reused


def assert_same(cached: list[EngineCompletion], full: list[EngineCompletion]) -> None:
    for c, f in zip(cached, full, strict=True):
        assert c.token_ids == f.token_ids
        gap = (torch.tensor(c.logprobs) - torch.tensor(f.logprobs)).abs().max()
        assert gap <= EXACT, f"cached-prefix logprobs differ from a full prefill's by {gap}"


@RUNNERS
def test_later_turns_prefill_only_their_new_tokens_with_full_prefill_logprobs(model_dir, decode) -> None:
    """Three turns of two episodes (one call per turn, a fresh prompt joining turn 2's call): from turn 2 on, an
    episode's prompt prefills only the last sampled token and the observation; every token and logprob equals
    the no-cache engine's."""
    cached = HFEngine(str(model_dir), decode=decode, max_batch_size=8)
    full = HFEngine(str(model_dir), decode=decode, max_batch_size=8, prefix_cache_tokens=0)
    conversations = [list(p) for p in EPISODES]
    for number in range(3):
        fresh = [[22, 3, 9]] if number == 1 else []  # no stored prefix: joins the same admission
        prompts = conversations + fresh
        got, computed, reused = turn(cached, prompts)
        want, full_computed, full_reused = turn(full, prompts)
        assert_same(got, want)
        assert (full_computed, full_reused) == (sum(map(len, prompts)), 0)
        if number == 0:
            assert (computed, reused) == (sum(map(len, prompts)), 0)
        else:
            new = [1 + len(o) for o in OBSERVATIONS[number - 1]]  # the last sampled token + observation
            assert computed == sum(new) + sum(map(len, fresh))
            assert reused == sum(len(c) for c in conversations) - sum(new)
        for episode, (conversation, completion) in enumerate(zip(conversations, got, strict=False)):
            conversation += completion.token_ids + (OBSERVATIONS[number][episode] if number < 2 else [])
    assert len(cached._prefix_cache) == 3 * len(EPISODES) + 1, "every finished row, while there is room"
    for engine in (cached, full):
        engine.close()


def test_a_prompt_joining_in_several_requests_is_prefilled_once(model_dir) -> None:
    """An episode group's first turns are alike, each a request (here: one request holding the prompt twice, and
    another joining the same step): the prompt is forwarded once for all of them."""
    engine = HFEngine(str(model_dir))
    engine.pause_in_flight()  # the requests queue up, then join one step together
    handles = [
        engine._batcher.submit(p, PARAMS, frozenset(), torch.tensor([])) for p in ([EPISODES[0]] * 2, [EPISODES[0]])
    ]
    engine.resume_in_flight(0)
    assert all(len(list(handle)) == n for handle, n in zip(handles, (2, 1), strict=True))
    assert engine.prefill_counts().computed == len(EPISODES[0])
    engine.close()


def test_a_prompt_that_shares_the_beginning_of_a_stored_one_takes_that_part() -> None:
    """No stored sequence is a prefix of the prompt, but one begins like it: its first tokens' KV serves."""
    cache = PrefixCache(100)
    kv = [torch.arange(12.0).view(1, 4, 3)]
    cache.store(CachedPrefix((4, 5, 6, 7), kv, kv), 0)
    hit = cache.lookup([4, 5, 9])
    assert hit.tokens == (4, 5) and torch.equal(hit.keys[0], kv[0][:, :2]) and torch.equal(hit.values[0], kv[0][:, :2])
    assert cache.lookup([4, 5, 6, 7, 8]).keys[0] is kv[0], "a whole entry: itself"
    assert cache.lookup([9, 4, 5]) is None and cache.lookup([4]) is None


@RUNNERS
def test_a_prompt_that_begins_like_a_finished_row_prefills_only_the_rest(model_dir, decode) -> None:
    """A prompt that shares its first tokens with a finished row (a system prompt, the tools) prefills the rest on
    that row's KV, with a full prefill's logprobs."""
    cached = HFEngine(str(model_dir), decode=decode)
    full = HFEngine(str(model_dir), decode=decode, prefix_cache_tokens=0)
    turn(cached, [EPISODES[1]])
    other = [[*EPISODES[1][:4], 20, 21]]
    got, computed, reused = turn(cached, other)
    want, _, _ = turn(full, other)
    assert (computed, reused) == (2, 4)
    assert_same(got, want)
    for engine in (cached, full):
        engine.close()


@RUNNERS
def test_prompts_joining_together_prefill_their_common_beginning_once(tmp_path, decode) -> None:
    """Prompts of one call that begin alike (a system prompt) for MIN_SHARED_BEGINNING tokens or more forward that
    beginning once and each its own tokens on its KV, with a full prefill's logprobs; a shorter common beginning is
    forwarded with each prompt."""
    model_dir = sharp_tiny_model(tmp_path, max_positions=2 * MIN_SHARED_BEGINNING)
    cached = HFEngine(str(model_dir), decode=decode)
    full = HFEngine(str(model_dir), decode=decode, prefix_cache_tokens=0)
    beginning = [3 + i % 19 for i in range(MIN_SHARED_BEGINNING)]
    prompts = [[*beginning, 20, 21], [*beginning, 22], [*beginning, 19, 3, 4]]
    got, computed, reused = turn(cached, prompts)
    want, _, _ = turn(full, prompts)
    assert (computed, reused) == (len(beginning) + 6, 3 * len(beginning))
    assert_same(got, want)
    shorter = [[*beginning[1:], 20], [*beginning[1:], 21]]  # alike for one token fewer, found nowhere in the cache
    assert turn(cached, shorter)[1:] == (sum(map(len, shorter)), 0)
    for engine in (cached, full):
        engine.close()


def test_shared_beginning_counts_the_first_tokens_every_sequence_has() -> None:
    assert shared_beginning([(4, 5, 6), (4, 5), (4, 5, 7, 8)]) == 2
    assert shared_beginning([(4, 5, 6), (4, 5, 6)]) == 3
    assert shared_beginning([(4, 9), (4, 5, 6), (5,)]) == 0


def change_weights(engine: HFEngine, how: str) -> None:
    """Each way the hf engine's weights change."""
    generator = torch.Generator().manual_seed(3)
    new = {n: p + 0.3 * torch.randn(p.shape, generator=generator) for n, p in engine.named_weights()}
    if how == "load_weights":
        engine.load_weights(new.items())
    elif how == "in_place":  # the worker's arena: written through named_weights, then weights_changed
        with torch.no_grad():
            for name, param in engine.named_weights():
                param.copy_(new[name])
        engine.weights_changed()
    elif how == "in_flight":
        engine.pause_in_flight()
        engine.resume_in_flight(1)
    else:
        spec = LoraAdapterSpec(rank=2, alpha=4.0, target_modules=("q_proj",))
        q = engine.model.model.layers[0].self_attn.q_proj
        tensors = {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(
                2, q.in_features, generator=generator
            ),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(
                q.out_features, 2, generator=generator
            ),
        }
        assert engine.load_adapter("policy-v1", spec, tensors) == 1


@RUNNERS
@pytest.mark.parametrize("how", ["load_weights", "in_place", "in_flight", "load_adapter"])
def test_a_weight_change_flushes_the_cache(model_dir, decode, how) -> None:
    """After any weight change the stored turn is not used: the next turn prefills in full, and its logprobs are
    those of a no-cache engine with the same new weights."""
    cached = HFEngine(str(model_dir), decode=decode, prefix_cache_tokens=1000)
    full = HFEngine(str(model_dir), decode=decode, prefix_cache_tokens=0)
    (first,), _, _ = turn(cached, [EPISODES[0]])
    for engine in (cached, full):
        change_weights(engine, how)
    assert len(cached._prefix_cache) == 0
    second = [EPISODES[0] + first.token_ids + OBSERVATIONS[0][0]]
    got, computed, reused = turn(cached, second)
    want, _, _ = turn(full, second)
    assert (computed, reused) == (len(second[0]), 0)
    assert_same(got, want)
    for engine in (cached, full):
        engine.close()


@pytest.mark.parametrize("mode", ["pause", "shadow"])
def test_a_worker_update_into_the_parameters_flushes_the_cache(model_dir, tmp_path, mode) -> None:
    """The worker writes an update into its arena (pause) or re-points the parameters to the other one (shadow),
    never through ``load_weights``: the next turn still prefills in full, with the new weights' logprobs."""
    engine = HFEngine(str(model_dir))
    worker = RolloutWorker(engine, "w0", mode=mode, limits=GenerationLimits())
    (first,), _, _ = turn(engine, [EPISODES[0]])
    weights, trained = new_weights(model_dir, seed=4)
    manifest = dataclasses.replace(sync_manifest(weights, version=1, transport="filesystem"), path=str(tmp_path))
    write_weights(tmp_path, manifest, weights)
    worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    second = EPISODES[0] + first.token_ids + OBSERVATIONS[0][0]
    (got,), computed, reused = turn(engine, [second])
    assert (computed, reused) == (len(second), 0)
    expected = recompute(trained, second, got.token_ids, PARAMS.temperature)
    assert (torch.tensor(got.logprobs) - torch.tensor(expected)).abs().max() <= EXACT
    engine.close()


def test_rows_whose_kv_predates_a_flush_are_not_stored(model_dir) -> None:
    """A row prefilled before a flush (here: one running while the engine's weights change in flight, its KV
    kept) finishes after it; its KV mixes two weight versions and is not stored."""
    engine = HFEngine(str(model_dir), partial="keep_kv")
    started, out = threading.Event(), []

    def run() -> None:
        for completion in engine.generate([EPISODES[0]], SamplingParams(max_tokens=40, ignore_eos=True)):
            out.append(completion)

    real_decode = engine._batcher.runner.decode

    def signalling_decode(*args):
        started.set()
        return real_decode(*args)

    engine._batcher.runner.decode = signalling_decode
    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    engine.pause_in_flight()
    engine.resume_in_flight(1)
    thread.join(60)
    assert out and out[0].token_versions is not None, "the row lived through the update"
    assert len(engine._prefix_cache) == 0
    engine.close()


def entry(tokens: list[int]) -> CachedPrefix:
    kv = [torch.zeros(1, len(tokens), 2)]
    return CachedPrefix(tuple(tokens), kv, kv)


def test_the_budget_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(10)
    assert cache.store(entry([1, 2, 3, 4]), 0) and cache.store(entry([5, 6, 7, 8]), 0)
    assert cache.lookup([1, 2, 3, 4, 9]).tokens == (1, 2, 3, 4)  # now the most recently used
    assert cache.store(entry([9, 10, 11]), 0)  # 11 tokens: [5..8] goes, the least recently used
    assert cache.lookup([5, 6, 7, 8, 9]) is None and 5 not in cache._root.children, "its trie nodes went too"
    assert cache.lookup([1, 2, 3, 4, 0]) is not None and cache.tokens == 7
    assert not cache.store(entry(list(range(11))), 0), "longer than the budget: not stored"
    assert not cache.store(entry([12]), epoch=1), "an epoch that is not the cache's: not stored"


def test_lookup_takes_the_longest_shared_prefix_and_what_a_row_continued_goes_first() -> None:
    cache = PrefixCache(12)
    cache.store(entry([1, 2]), 0)
    cache.store(entry([1, 2, 3]), 0)  # another episode that began alike: both stay
    assert cache.lookup([1, 2]).tokens == (1,), "at least one token is left to prefill"
    assert cache.lookup([1, 2, 7]).tokens == (1, 2)
    assert cache.lookup([1, 2, 3, 4]).tokens == (1, 2, 3), "the longest"
    cache.store(entry([1, 2, 3, 4]), 0, extends=(1, 2, 3))  # the next turn of the row prefilled on [1, 2, 3] ...
    assert (len(cache), cache.tokens) == (3, 9), "... kept while there is room"
    cache.store(entry([5, 6, 7]), 0)  # 12 tokens: nothing goes
    cache.store(entry([5, 6, 7]), 0)  # an equal sequence replaces, never doubles
    assert (len(cache), cache.tokens) == (4, 12)
    cache.store(entry([8, 9]), 0)  # [1, 2, 3] goes first though [1, 2] was used before it
    assert cache.lookup([1, 2, 3, 9]).tokens == (1, 2, 3), "shared with [1, 2, 3, 4]"
    assert cache.tokens == 11
    assert cache.flush() == 4 and cache.lookup([1, 2, 3, 4, 5]) is None and cache.epoch == 1
    with pytest.raises(ValueError, match=r"rollout\.prefix_cache_tokens"):
        PrefixCache(-1)
