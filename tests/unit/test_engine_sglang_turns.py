"""The sglang adapter across turns and weight versions, on the fake ``sglang`` (tests/fakes/fake_sglang.py), whose
scheduler keeps a radix cache as SGLang's (token prefixes keyed by ``cache_salt``/LoRA, each position remembering
the weights its KV was computed under): a later turn sent as ``input_ids`` prefills only its new tokens; a weight
update in flight (``pause_generation(mode="in_place")``, an update with ``flush_cache=False``,
``continue_generation``) keeps every row, stamps each token with the version that sampled it, and no new request
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
from fakes import fake_sglang

from relayrl.rollout.sglang import SGLangEngine
from relayrl.weightsync.filesystem import write_weights
from relayrl.wire.sampling import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    for name in fake_sglang.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_sglang)
    eng = SGLangEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0, enable_deterministic_inference=True)
    yield eng
    eng.close()


def test_a_later_turn_is_sent_as_input_ids_and_prefills_only_its_new_tokens(engine: SGLangEngine, model_dir) -> None:
    """Three turns of one conversation, each sent as ``input_ids`` = the previous prompt + the sampled ids + an
    observation: SGLang's radix cache serves the whole conversation so far but the last sampled token, so a turn
    prefills its observation and one token more."""
    params = SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    observation = [15, 16, 17]
    conversation = list(PROMPTS[1])
    reference = load(model_dir)
    for turn in range(3):
        (completion,) = engine.generate([conversation], params)
        call = engine.engine.generate_calls[-1]
        assert call["input_ids"] == [conversation] and call["cache_salt"] == ["relayrl-v0"]
        prompt_tokens, cached, stale = engine.engine.admissions[call["rid"][0]]
        assert prompt_tokens == len(conversation) and not stale
        assert prompt_tokens - cached == (len(conversation) if turn == 0 else len(observation) + 1)
        expected = recompute(reference, conversation, completion.token_ids, 1.0)
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)
        conversation += completion.token_ids + observation


def write_update(model_dir: Path, tmp_path: Path, version: int):
    weights, trained = new_weights(model_dir, seed=version)
    manifest = sync_manifest(weights, version=version, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    return dataclasses.replace(manifest, path=str(tmp_path.resolve())), trained


def test_an_update_in_flight_keeps_the_rows_and_stamps_each_tokens_version(
    engine: SGLangEngine, model_dir: Path, tmp_path: Path
) -> None:
    """Rows frozen in place after 4 tokens, new weights loaded under them without a flush (a flush fails while
    they hold KV), ``resume_in_flight(1)``: every row finishes its 20 tokens, admitted once; tokens 0-3 carry
    version 0 and the old model's logprobs, tokens 4-19 version 1 and the new model's."""
    manifest, trained = write_update(model_dir, tmp_path, version=1)
    fake = engine.engine
    fake.hold_after = 4
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=9, ignore_eos=True)
    results = []
    thread = threading.Thread(target=lambda: results.extend(engine.generate(PROMPTS, params)))
    thread.start()
    assert fake.held.wait(timeout=120)
    engine.pause_in_flight()
    fake.release()
    engine.receive_update(manifest)
    assert engine.loaded_checksum() == manifest.checksum and len(fake.steps) == 4 and fake.cache_flushes == 0
    engine.resume_in_flight(1)
    thread.join(timeout=120)
    assert len(results) == 6 and len(fake.admissions) == 6
    assert_continued_across_update(results, model_dir, trained, frozen_at=4)


def test_after_an_update_in_flight_no_new_request_reuses_the_old_weights_kv(
    engine: SGLangEngine, model_dir: Path, tmp_path: Path
) -> None:
    """Unflushed, the radix cache still holds version 0's KV: the adapter salts new requests with the version, so
    a prompt cached under version 0 is prefilled again under version 1, then reused within version 1. The old
    salt (what an unsalted adapter would send) is served the old weights' KV."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=3)
    list(engine.generate(PROMPTS[1:2], params))
    manifest, _ = write_update(model_dir, tmp_path, version=1)
    engine.pause_in_flight()
    engine.receive_update(manifest)
    engine.resume_in_flight(1)
    for expected_cached in (0, len(PROMPTS[1]) - 1):
        list(engine.generate(PROMPTS[1:2], params))
        call = engine.engine.generate_calls[-1]
        assert call["cache_salt"] == ["relayrl-v1"]
        assert engine.engine.admissions[call["rid"][0]][1:] == (expected_cached, False)
    sampling = {"max_new_tokens": 1, "temperature": 0.0}
    old_salt = ["relayrl-v0"]
    engine.engine.generate(input_ids=[PROMPTS[1]], sampling_params=[sampling], rid=["unsalted"], cache_salt=old_salt)
    assert engine.engine.admissions["unsalted"][1:] == (len(PROMPTS[1]) - 1, True)
