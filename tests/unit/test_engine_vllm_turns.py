"""The vllm adapter across turns and weight versions, on the fake ``vllm`` (tests/fakes/fake_vllm.py), whose engine
core keeps a prefix cache as vLLM's (blocks of ``block_size`` tokens keyed by the tokens before them and the
request's ``cache_salt``/LoRA, each remembering the weights its KV was computed under): a later turn sent as token
ids prefills only its new tokens; a weight update in flight (``pause_generation(mode="keep", clear_cache=False)``,
``resume_scheduler``) keeps every row, stamps each token with the version that sampled it, and no new request
reuses KV of the old weights."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
from engine_testing import (
    PROMPTS,
    assert_continued_across_update,
    load,
    new_weights,
    recompute,
    sharp_tiny_model,
    sync_manifest,
)
from fakes import fake_vllm

from relayrl.rollout.vllm import VLLMEngine
from relayrl.weightsync.filesystem import write_weights
from relayrl.wire.sampling import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    for name in fake_vllm.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_vllm)
    eng = VLLMEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0, block_size=BLOCK)
    yield eng
    eng.close()


def admission(engine: VLLMEngine, request_id: str) -> tuple[int, int, bool]:
    """(prompt tokens, tokens the prefix cache served, whether it served KV computed under other weights)."""
    return tuple(engine.llm.fake_probe("admissions")[request_id])


def test_a_later_turn_is_sent_as_token_ids_and_prefills_only_its_new_tokens(engine: VLLMEngine, model_dir) -> None:
    """Three turns of one conversation: each turn's prompt is the previous prompt + the sampled ids + an
    observation, sent as ``TokensPrompt(prompt_token_ids=...)``; vLLM serves every full block of the conversation
    so far from its cache, so a turn prefills its observation and less than a block more."""
    params = SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    observation = [15, 16, 17]
    conversation = list(PROMPTS[1])
    reference = load(model_dir)
    computed = 0  # tokens of the conversation whose KV the last turn computed
    for turn in range(3):
        (completion,) = engine.generate([conversation], params)
        request_id, prompt, _ = engine.llm.llm_engine.added[-1]
        assert prompt["prompt_token_ids"] == conversation
        prompt_tokens, cached, stale = admission(engine, request_id)
        assert prompt_tokens == len(conversation) and not stale
        if turn == 0:
            assert cached == 0
        else:  # the KV of every token but the last sampled one was computed: all its full blocks are cached
            assert cached == computed // BLOCK * BLOCK
            assert prompt_tokens - cached <= len(observation) + BLOCK
        expected = recompute(reference, conversation, completion.token_ids, 1.0)
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)
        computed = len(conversation) + len(completion.token_ids) - 1
        conversation += completion.token_ids + observation


def write_update(model_dir: Path, tmp_path: Path, version: int):
    """New weights published on the filesystem as ``version``: (manifest, the trainer's model)."""
    weights, trained = new_weights(model_dir, seed=version)
    manifest = sync_manifest(weights, version=version, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    return dataclasses.replace(manifest, path=str(tmp_path.resolve())), trained


def test_an_update_in_flight_keeps_the_rows_and_stamps_each_tokens_version(
    engine: VLLMEngine, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows frozen after 4 tokens by ``pause_in_flight``, new weights loaded under them, ``resume_in_flight(1)``:
    every row finishes its 20 tokens without restarting (one admission each), tokens 0-3 carry version 0 and the
    old model's logprobs, tokens 4-19 version 1 and the new model's."""
    manifest, trained = write_update(model_dir, tmp_path, version=1)
    llm_engine = engine.llm.llm_engine
    step, reached, gate = llm_engine.step, threading.Event(), threading.Event()

    def gated_step():  # hold the stepper after 4 steps until the test has paused the engine core
        if len(llm_engine.steps) == 4:
            reached.set()
            gate.wait()
        return step()

    monkeypatch.setattr(llm_engine, "step", gated_step)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=9, ignore_eos=True)
    results = []
    thread = threading.Thread(target=lambda: results.extend(engine.generate(PROMPTS, params)))
    thread.start()
    assert reached.wait(timeout=120)
    engine.pause_in_flight()
    gate.set()
    assert engine.llm.fake_probe("admissions") and engine.llm.reset_prefix_cache() is False  # rows hold blocks
    engine.receive_update(manifest)
    assert engine.loaded_checksum() == manifest.checksum and len(llm_engine.steps) == 4
    engine.resume_in_flight(1)
    thread.join(timeout=120)
    assert len(results) == 6 and len(llm_engine.added) == 6
    assert_continued_across_update(results, model_dir, trained, frozen_at=4)


def test_after_an_update_in_flight_no_new_request_reuses_the_old_weights_kv(
    engine: VLLMEngine, model_dir: Path, tmp_path: Path
) -> None:
    """The frozen rows keep vLLM from resetting its prefix cache, so the adapter salts new requests with the
    version: a prompt cached under version 0 is prefilled again under version 1, and reused within version 1.
    The same request with the old salt (what an unsalted adapter would send) is served the old weights' KV."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=3)
    list(engine.generate(PROMPTS[1:2], params))  # caches the prompt's blocks under version 0
    manifest, _ = write_update(model_dir, tmp_path, version=1)
    engine.pause_in_flight()
    engine.receive_update(manifest)
    engine.resume_in_flight(1)
    for expected_cached in (0, BLOCK * ((len(PROMPTS[1]) - 1) // BLOCK)):
        list(engine.generate(PROMPTS[1:2], params))
        request_id, prompt, _ = engine.llm.llm_engine.added[-1]
        assert prompt["cache_salt"] == "relayrl-v1"
        assert admission(engine, request_id)[1:] == (expected_cached, False)
    unsalted = fake_vllm.SamplingParams(max_tokens=1, output_kind=fake_vllm.RequestOutputKind.FINAL_ONLY)
    old_key = fake_vllm.TokensPrompt(prompt_token_ids=PROMPTS[1], cache_salt="relayrl-v0")
    engine.llm.llm_engine.add_request("unsalted", old_key, unsalted)
    while engine.llm.llm_engine.has_unfinished_requests():
        engine.llm.llm_engine.step()
    assert admission(engine, "unsalted")[1:] == (BLOCK * ((len(PROMPTS[1]) - 1) // BLOCK), True)
