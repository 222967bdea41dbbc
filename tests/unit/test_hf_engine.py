"""HFEngine on the tiny Qwen2: logprobs match a plain forward, finish reasons, seeding, weights, abort."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from engine_testing import assert_stop_string_ends_the_sample, sharp_tiny_model
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.rollout.engine import ENGINES, EngineCompletion, create_engine
from relayrl.rollout.hf import HFEngine, inverse_cdf, top_p_filter
from relayrl.wire.sampling import SamplingParams

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [14]]  # different lengths: left padding matters
EOS = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its matrices scaled x4: at init its attention is nearly uniform, which would let
    mistakes in masks or positions hide below the tolerance."""
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    return HFEngine(str(model_dir), max_batch_size=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    """A freshly loaded copy of the model: the trainer's view."""
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def by_key(completions: list[EngineCompletion]) -> dict[tuple[int, int], EngineCompletion]:
    keys = [(c.prompt_index, c.sample_index) for c in completions]
    assert len(keys) == len(set(keys)), "every sample is yielded exactly once"
    return dict(zip(keys, completions, strict=True))


@torch.no_grad()
def recompute_logprobs(model, prompt: Sequence[int], response: Sequence[int], temperature: float) -> list[float]:
    """One full forward of prompt + response: no cache, no padding."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logprobs_from_logits(logits, torch.tensor(response), temperature).tolist()


@torch.no_grad()
def argmax_decode(model, prompt: Sequence[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == EOS:
            break
    return ids[len(prompt) :]


# the fast decode runner (auto) and the transformers forward (the eager one: its SDPA is covered by test_llama_decode)
RUNNERS = pytest.mark.parametrize(("attn", "decode"), [("sdpa", "auto"), ("eager", "transformers")])


@RUNNERS
def test_logprobs_equal_a_full_forward_of_prompt_and_response(model_dir, reference, attn, decode) -> None:
    engine = HFEngine(str(model_dir), attn_implementation=attn, decode=decode, max_batch_size=5)  # splits samples
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=12, seed=7)
    completions = by_key(list(engine.generate(PROMPTS, params)))
    assert set(completions) == {(p, s) for p in range(len(PROMPTS)) for s in range(4)}
    for (p, _), c in completions.items():
        assert len(c.logprobs) == len(c.token_ids) > 0
        expected = recompute_logprobs(reference, PROMPTS[p], c.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_eos_ends_with_stop_and_max_tokens_with_length(engine) -> None:
    assert engine.eos_token_ids == frozenset({EOS})
    params = SamplingParams(n=8, max_tokens=10, seed=3)
    completions = list(engine.generate(PROMPTS, params))
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    for c in completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == params.max_tokens and EOS not in c.token_ids


def test_stop_strings_end_the_sample_as_vllm_does(engine, model_dir) -> None:
    assert_stop_string_ends_the_sample(engine, model_dir)


def test_stop_strings_wait_for_min_tokens(engine) -> None:
    """The greedy response to PROMPTS[1] is "000000000222": "02" completes at token 10, so with min_tokens 10 the
    first check that may end the row is at token 11 (whose text holds "02" too)."""
    params = SamplingParams(temperature=0, max_tokens=12, stop=("02",))
    (plain,) = engine.generate(PROMPTS[1:2], params)
    (held,) = engine.generate(PROMPTS[1:2], dataclasses.replace(params, min_tokens=10))
    assert (len(plain.token_ids), len(held.token_ids)) == (10, 11)
    assert plain.finish_reason == held.finish_reason == "stop"


def test_stop_token_ends_the_sample_and_is_included(engine) -> None:
    first = [c.token_ids[0] for c in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))]
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=tuple(first))
    for c in engine.generate(PROMPTS, params):
        assert (c.token_ids, c.finish_reason) == ([first[c.prompt_index]], "stop")


def test_same_seed_same_tokens_and_unseeded_requests_differ(engine) -> None:
    params = SamplingParams(n=4, max_tokens=8, seed=123)
    tokens = lambda p: {k: c.token_ids for k, c in by_key(list(engine.generate(PROMPTS, p))).items()}  # noqa: E731
    assert tokens(params) == tokens(params)
    unseeded = SamplingParams(n=4, max_tokens=8)
    assert tokens(unseeded) != tokens(unseeded)


def test_temperature_zero_is_argmax_decoding(engine, reference) -> None:
    params = SamplingParams(n=2, temperature=0, max_tokens=8)
    for (p, _), c in by_key(list(engine.generate(PROMPTS, params))).items():
        assert c.token_ids == argmax_decode(reference, PROMPTS[p], params.max_tokens)
        expected = recompute_logprobs(reference, PROMPTS[p], c.token_ids, 1.0)  # greedy: logprobs at T = 1
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_tiny_top_p_acts_like_greedy(engine) -> None:
    greedy = by_key(list(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=8))))
    nucleus = by_key(list(engine.generate(PROMPTS, SamplingParams(n=2, top_p=1e-6, max_tokens=8, seed=5))))
    assert {k: c.token_ids for k, c in nucleus.items()} == {k: c.token_ids for k, c in greedy.items()}


def test_top_p_filter_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    kept = lambda top_p: (top_p_filter(probs, top_p) > 0).int().tolist()[0]  # noqa: E731
    assert kept(1e-9) == [0, 1, 0, 0]
    assert kept(0.7) == kept(0.75) == [0, 1, 0, 1]
    assert kept(0.76) == [0, 1, 1, 1]
    assert torch.equal(top_p_filter(probs, 0.7)[0, [1, 3]], probs[0, [1, 3]])
    assert top_p_filter(probs, 1.0) is probs


def test_load_weights_changes_outputs_and_named_weights(model_dir) -> None:
    engine = HFEngine(str(model_dir))
    params = SamplingParams(n=1, temperature=0, max_tokens=6)
    before = [c.logprobs for c in engine.generate(PROMPTS, params)]
    generator = torch.Generator().manual_seed(0)
    new = {name: torch.randn(t.shape, generator=generator) for name, t in engine.named_weights()}
    names = list(new)
    engine.load_weights((n, new[n]) for n in names[::2])  # two disjoint buckets
    engine.load_weights((n, new[n]) for n in names[1::2])
    for name, tensor in engine.named_weights():
        assert torch.equal(tensor, new[name]), name
    after = [c.logprobs for c in engine.generate(PROMPTS, params)]
    assert after != before
    fresh = HFEngine(str(model_dir))
    fresh.load_weights(new.items())
    assert [c.logprobs for c in fresh.generate(PROMPTS, params)] == after


def test_load_weights_rejects_unknown_names_and_shapes_without_copying(model_dir) -> None:
    engine = HFEngine(str(model_dir))
    norm = dict(engine.named_weights())["model.norm.weight"]
    original = norm.clone()
    with pytest.raises(ValueError, match=r"model\.nope\.weight"):
        engine.load_weights([("model.norm.weight", original + 1), ("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        engine.load_weights([("model.norm.weight", original + 1), ("model.layers.0.mlp.up_proj.weight", norm)])
    assert torch.equal(norm, original), "a refused call copies nothing"


def test_named_weights_list_tied_embeddings_once(engine) -> None:
    weights = list(engine.named_weights())
    names = [name for name, _ in weights]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len({t.untyped_storage().data_ptr() for _, t in weights}) == len(weights)
    specs = engine.weight_specs()
    assert [(n, s, d) for n, s, d in specs] == [(n, tuple(t.shape), t.dtype) for n, t in weights]


def test_named_weights_are_the_live_parameters(model_dir) -> None:
    """A worker may load into shadow tensors and swap storages with ``.data``: that must reach the model."""
    engine = HFEngine(str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=4)
    before = [c.logprobs for c in engine.generate(PROMPTS, params)]
    for _, tensor in engine.named_weights():
        tensor.data = tensor.data * 0.5
    assert torch.equal(engine.model.lm_head.weight, dict(engine.named_weights())["model.embed_tokens.weight"])
    assert [c.logprobs for c in engine.generate(PROMPTS, params)] != before


def test_tied_alias_loads_into_the_shared_tensor(model_dir) -> None:
    engine = HFEngine(str(model_dir))
    embedding = dict(engine.named_weights())["model.embed_tokens.weight"]
    engine.load_weights([("lm_head.weight", torch.ones_like(embedding))])
    assert torch.equal(embedding, torch.ones_like(embedding))


def test_should_abort_yields_the_rest_as_abort(engine) -> None:
    calls = 0

    def should_abort() -> bool:
        nonlocal calls
        calls += 1
        return calls > 3

    params = SamplingParams(n=4, max_tokens=20, seed=0)  # 12 rows, chunks of 5: the later chunks never start
    completions = by_key(list(engine.generate(PROMPTS, params, should_abort)))
    assert len(completions) == len(PROMPTS) * params.n
    aborted = [c for c in completions.values() if c.finish_reason == "abort"]
    assert aborted and all(len(c.token_ids) == len(c.logprobs) <= 3 for c in aborted)
    assert any(c.token_ids == [] for c in aborted)  # rows of chunks that never started
    assert all(c.token_ids[-1] == EOS for c in completions.values() if c.finish_reason == "stop")


def test_abort_before_start_yields_only_aborts(engine) -> None:
    completions = list(engine.generate(PROMPTS, SamplingParams(n=2), lambda: True))
    assert [(c.finish_reason, c.token_ids) for c in completions] == [("abort", [])] * 6


def test_registry_creates_hf_and_lists_known_engines(model_dir) -> None:
    assert isinstance(create_engine("hf", model_path=str(model_dir)), HFEngine)
    with pytest.raises(ValueError, match="known engines: hf"):
        create_engine("nope")
    assert "hf" in ENGINES


def generate_in_threads(
    engine: HFEngine, calls: list[tuple[list[list[int]], SamplingParams]], delays: list[float], step_s: float = 0.005
):
    """Run each call's ``generate`` in its own thread (after its delay); returns each call's completions. Each
    decode step takes at least ``step_s`` (a sleep, no change to what it computes), so calls started ``delays``
    apart find the earlier ones still decoding on any machine (a fast one finished a call within 20 ms)."""
    results: list[list[EngineCompletion]] = [[] for _ in calls]
    runner = engine._batcher.runner
    decode = runner.decode

    def paced(*args):
        time.sleep(step_s)
        return decode(*args)

    runner.decode = paced

    def run(i: int) -> None:
        time.sleep(delays[i])
        results[i] = list(engine.generate(*calls[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    del runner.decode  # the class's own again
    return results


@RUNNERS
def test_concurrent_calls_share_decode_steps_and_keep_exact_logprobs(model_dir, reference, attn, decode) -> None:
    """Rows of four calls (different prompt lengths, temperatures, top-p, n) join and leave one running batch;
    every logprob still equals a plain unpadded forward of prompt + response."""
    engine = HFEngine(str(model_dir), attn_implementation=attn, decode=decode, max_batch_size=64)
    calls = [
        ([PROMPTS[0], PROMPTS[2]], SamplingParams(n=3, temperature=1.0, max_tokens=14, seed=1)),
        ([PROMPTS[1]], SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=9)),
        ([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3]], SamplingParams(n=2, temperature=0, max_tokens=6)),
        ([PROMPTS[2], PROMPTS[1]], SamplingParams(n=2, temperature=1.3, max_tokens=12, ignore_eos=True)),
    ]
    results = generate_in_threads(engine, calls, delays=[0.0, 0.01, 0.03, 0.05])
    for (prompts, params), completions in zip(calls, results, strict=True):
        got = by_key(completions)
        assert set(got) == {(p, s) for p in range(len(prompts)) for s in range(params.n)}
        for (p, _), c in got.items():
            temperature = params.temperature or 1.0
            expected = recompute_logprobs(reference, prompts[p], c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    assert engine._batcher.peak_requests >= 2, "rows of different calls were never decoded together"


def test_a_seeded_request_does_not_depend_on_other_traffic(model_dir) -> None:
    engine = HFEngine(str(model_dir), max_batch_size=64)
    seeded = ([PROMPTS[0], PROMPTS[1]], SamplingParams(n=3, max_tokens=10, seed=11))
    alone = {k: c.token_ids for k, c in by_key(list(engine.generate(*seeded))).items()}
    noise = ([PROMPTS[2]] * 3, SamplingParams(n=4, max_tokens=16))
    shared = generate_in_threads(engine, [noise, seeded, noise], delays=[0.0, 0.01, 0.02])[1]
    assert {k: c.token_ids for k, c in by_key(shared).items()} == alone


def test_ignore_eos_and_min_tokens(model_dir, reference) -> None:
    engine = HFEngine(str(model_dir), max_batch_size=64)
    eos_prone = SamplingParams(n=8, temperature=2.0, max_tokens=12, seed=4)
    assert any(c.finish_reason == "stop" for c in engine.generate(PROMPTS, eos_prone)), "needs EOS to be sampled"
    for c in engine.generate(PROMPTS, dataclasses.replace(eos_prone, ignore_eos=True)):
        assert (c.finish_reason, len(c.token_ids)) == ("length", 12)
    for c in engine.generate(PROMPTS, dataclasses.replace(eos_prone, min_tokens=5)):
        assert len(c.token_ids) >= 5 and EOS not in c.token_ids[:5]
        # the reported logprob stays that of the unmasked softmax (vLLM's raw log-probs)
        expected = recompute_logprobs(reference, PROMPTS[c.prompt_index], c.token_ids, eos_prone.temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_a_caller_that_stops_listening_frees_its_rows(model_dir) -> None:
    engine = HFEngine(str(model_dir), max_batch_size=4)
    stream = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()  # the rest of this request leaves the batch; the engine serves the next call
    done = list(engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=3)))
    assert len(done) == len(PROMPTS)


def test_only_the_scheduler_thread_runs_multithreaded_torch(model_dir) -> None:
    """``threads``: decoding uses that many intra-op threads and every other thread of the process (a gRPC thread
    loading weights) one, so libgomp never holds two teams (relayrl/rollout/intra_op.py)."""
    before = torch.get_num_threads()
    engine = HFEngine(str(model_dir), max_batch_size=8, threads=2)
    seen: list[int] = []
    decode = engine._batcher.runner.decode

    def counting_decode(*args):
        seen.append(torch.get_num_threads())
        return decode(*args)

    engine._batcher.runner.decode = counting_decode
    try:
        list(engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=1)))
        loader: list[int] = []
        thread = threading.Thread(target=lambda: loader.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen and set(seen) == {2}
        assert loader == [1] and torch.get_num_threads() == 1
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_inverse_cdf_draws_each_index_with_its_weights_share_and_never_a_zero_weight() -> None:
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0, 6.0, 0.0]]).repeat(4000, 1)
    picks = inverse_cdf(weights, torch.Generator().manual_seed(0))
    counts = torch.bincount(picks, minlength=7).float() / len(picks)
    assert counts[[0, 2, 4, 6]].sum() == 0
    assert torch.allclose(counts[[1, 3, 5]], torch.tensor([0.1, 0.3, 0.6]), atol=0.03), counts


def test_with_a_generator_a_row_its_pick_depends_on_its_own_row_alone() -> None:
    weights = torch.rand(6, 50, generator=torch.Generator().manual_seed(1))
    together = inverse_cdf(weights, [torch.Generator().manual_seed(i) for i in range(6)])
    alone = torch.cat([inverse_cdf(weights[i : i + 1], [torch.Generator().manual_seed(i)]) for i in range(6)])
    assert torch.equal(together, alone)
