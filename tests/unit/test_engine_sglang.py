"""The sglang engine adapter, driven through the fake ``sglang`` module (tests/fakes/fake_sglang.py) on
the tiny model: logprobs as the trainer computes them (top-p included), finish reasons, n samples and seeds,
the arguments SGLang receives, abort, loading weights directly and through the rollout worker's weight sync
(the custom-loader route), and the fake's API surface against the one recorded in docs/engines.md."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import uuid
from pathlib import Path

import pytest
import torch
from engine_testing import (
    EOS,
    PROMPTS,
    accepted,
    assert_concurrent_calls_exact,
    assert_stop_string_ends_the_sample,
    assert_trainer_logprobs,
    by_key,
    documented,
    load,
    new_weights,
    record,
    send_in_background,
    sharp_tiny_model,
    sync_manifest,
)
from fakes import fake_sglang
from fakes.common import FakeEngineModel

from relayrl.errors import FailedPrecondition, InvalidArgument
from relayrl.rollout import sglang as adapter
from relayrl.rollout.engine import create_engine, engine_class
from relayrl.rollout.external import GroupArgs
from relayrl.rollout.sglang import LOADER, SGLangEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.runtime.ports import free_port
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.wire.sampling import GenerationLimits, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    for name in fake_sglang.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_sglang)
    monkeypatch.setattr(adapter, "_RECEIVERS", {})  # each test starts with fresh schedulers
    return fake_sglang


@pytest.fixture
def engine(fake, model_dir: Path):
    eng = SGLangEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0, enable_deterministic_inference=True)
    yield eng
    eng.close()


def group_name() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def test_registered_and_created_by_name(fake, model_dir: Path) -> None:
    assert engine_class("sglang") is SGLangEngine
    eng = create_engine("sglang", model_path=str(model_dir), dtype="float32", max_batch_size=4, seed=0)
    assert (eng.name, eng.vocab_size, eng.max_model_len, eng.eos_token_ids) == ("sglang", 23, 64, frozenset({EOS}))
    assert eng.receives_weights_itself and eng.weight_sync_ranks == 1
    eng.close()
    assert eng.engine.closed and not os.path.exists(eng._receipts)


def test_generate_n_samples_with_the_trainers_logprobs_even_under_top_p(engine: SGLangEngine, model_dir) -> None:
    params = SamplingParams(n=3, temperature=0.7, top_p=0.8, max_tokens=12, seed=7)
    completions = by_key(list(engine.generate(PROMPTS, params)))
    assert set(completions) == {(p, s) for p in range(len(PROMPTS)) for s in range(3)}
    for c in completions.values():
        assert len(c.logprobs) == len(c.token_ids) > 0
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == params.max_tokens
    assert_trainer_logprobs(load(model_dir), PROMPTS, completions, params.temperature)


def test_greedy_logprobs_are_at_temperature_one(engine: SGLangEngine, model_dir: Path) -> None:
    completions = by_key(list(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=8))))
    for p in range(len(PROMPTS)):
        assert completions[p, 0].token_ids == completions[p, 1].token_ids
    assert_trainer_logprobs(load(model_dir), PROMPTS, completions, 1.0)


def test_seeded_samples_are_reproducible_and_distinct(engine: SGLangEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=5)
    first = by_key(list(engine.generate(PROMPTS[:1], params)))
    again = by_key(list(engine.generate(PROMPTS[:1], params)))
    assert {k: c.token_ids for k, c in first.items()} == {k: c.token_ids for k, c in again.items()}
    assert len({tuple(c.token_ids) for c in first.values()}) > 1


def test_arguments_reach_sglang_as_documented(engine: SGLangEngine, model_dir: Path) -> None:
    assert vars(engine.engine.server_args) == {
        "model_path": str(model_dir),
        "dtype": "float32",
        "random_seed": 0,
        "max_running_requests": 8,
        "custom_weight_loader": [LOADER],
        "weight_version": "0",
        "enable_deterministic_inference": True,
    }
    params = SamplingParams(n=2, temperature=0.5, top_p=0.9, max_tokens=4, stop_token_ids=(5, 9), seed=11)
    list(engine.generate(PROMPTS[:2], params))
    list(engine.generate(PROMPTS[:1], dataclasses.replace(params, seed=None)))
    seeded, unseeded = engine.engine.generate_calls
    assert seeded["input_ids"] == [PROMPTS[p] for p in range(2) for _ in range(2)]
    assert seeded["return_logprob"] is True and len(set(seeded["rid"])) == 4
    assert seeded["cache_salt"] == ["relayrl-v0"] * 4  # the policy version's (test_engine_sglang_turns.py)
    neutral = {
        "max_new_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": [5, 9],
        "ignore_eos": False,
        "stop": None,
        "no_stop_trim": False,
    }
    assert seeded["sampling_params"] == [{**neutral, "sampling_seed": 11 + s} for _ in range(2) for s in range(2)]
    drawn = [item.pop("sampling_seed") for item in unseeded["sampling_params"]]
    assert unseeded["sampling_params"] == [neutral, neutral] and len(set(drawn)) == 2
    list(engine.generate(PROMPTS[:1], dataclasses.replace(params, ignore_eos=True)))
    assert engine.engine.generate_calls[-1]["sampling_params"][0]["ignore_eos"] is True
    list(engine.generate(PROMPTS[:1], dataclasses.replace(params, stop=("x",), include_stop_str_in_output=True)))
    sent = engine.engine.generate_calls[-1]["sampling_params"][0]
    assert (sent["stop"], sent["no_stop_trim"]) == (["x"], True)


def test_seedless_samples_differ_under_deterministic_inference(engine: SGLangEngine) -> None:
    """SGLang gives every seedless request seed 42 under deterministic inference (sampling_batch_info.py): the
    adapter must seed each sample itself, or the n samples of a prompt are all the same (GRPO advantages 0)."""
    completions = by_key(list(engine.generate(PROMPTS[:1], SamplingParams(n=4, temperature=1.0, max_tokens=10))))
    assert len({tuple(c.token_ids) for c in completions.values()}) > 1


def test_ignore_eos_runs_to_max_tokens_and_min_tokens_is_refused(engine: SGLangEngine) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    for c in engine.generate(PROMPTS, params):
        assert c.finish_reason == "length" and len(c.token_ids) == 12
    with pytest.raises(InvalidArgument, match=r"^params.min_tokens: the sglang engine"):
        list(engine.generate(PROMPTS, dataclasses.replace(params, min_tokens=2)))


def test_an_unsupported_sglang_version_is_refused_naming_the_range(fake, model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(fake_sglang, "__version__", "0.5.1")
    with pytest.raises(ImportError, match=re.escape("supports sglang>=0.5.23,<0.6, found 0.5.1")):
        SGLangEngine(str(model_dir), dtype="float32")


def test_speculative_decoding_is_refused(fake, model_dir: Path) -> None:
    """SGLang runs a custom weight loader once per runner (target and draft): relayrl's receive would run twice."""
    with pytest.raises(ValueError, match="speculative_algorithm: speculative decoding is not supported"):
        SGLangEngine(str(model_dir), dtype="float32", speculative_algorithm="EAGLE")


def test_pipeline_parallel_schedulers_get_distinct_ranks(fake, model_dir: Path) -> None:
    """Group ranks and receipts are keyed by pp_rank * tp_size + tp_rank: TP ranks alone collide for pp > 1."""
    eng = SGLangEngine(str(model_dir), dtype="float32", seed=0, tp_size=1, pp_size=2)
    assert eng.weight_sync_ranks == 2
    weights, _ = new_weights(model_dir)
    name = group_name()
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, group_name=name, backend="gloo", timeout_s=30) as trainer:
        group = eng.init_weight_sync(GroupArgs("127.0.0.1", trainer.port, 1, 3, name, "gloo", 30.0))
        manifest = sync_manifest(weights)
        join = send_in_background(trainer, manifest, weights)
        eng.receive_update(manifest)
        join()
        group.close()
        assert [adapter._RECEIVERS[r].group.rank for r in range(2)] == [1, 2]
    assert eng.loaded_checksum() == manifest.checksum
    eng.close()


def test_the_fake_refuses_to_flush_while_requests_are_queued(engine: SGLangEngine, model_dir: Path) -> None:
    """As SGLang 0.5.23: the update is applied but the call fails when requests are still running or queued
    (the adapter runs updates only once no call streams)."""
    fake_engine = engine.engine
    item = {"max_new_tokens": 4, "temperature": 1.0}
    fake_engine.loop.run_until_complete(
        fake_engine.async_generate(input_ids=[PROMPTS[0]], sampling_params=[item], stream=True)
    )
    assert fake_engine.running == 1
    weights, _ = new_weights(model_dir)
    assert fake_engine.begin_weight_update() == (True, "Success")
    ok, message = fake_engine.update_weights_from_tensor(named_tensors=list(weights.items()), flush_cache=True)
    fake_engine.end_weight_update()
    assert not ok and message == fake_sglang.FLUSH_REFUSED


def test_concurrent_calls_share_scheduler_batches(engine: SGLangEngine, model_dir: Path) -> None:
    """Four generate calls from four threads: each gets exactly its samples with the trainer's logprobs, and
    SGLang's scheduler ran items of different calls in the same step."""
    assert_concurrent_calls_exact(engine, model_dir)
    calls_per_step = [len({rid.split("-")[1] for rid in step}) for step in engine.engine.steps]
    assert max(calls_per_step) > 1
    weights, _ = new_weights(model_dir)
    engine.load_weights(weights.items())  # updates run once no call streams
    assert engine.engine.cache_flushes == 1


def test_closing_ends_the_fakes_scheduler_task(fake, model_dir: Path) -> None:
    """Nothing is left pending on the engine's loop once the adapter is closed (a pending task left behind
    is reported as destroyed when the loop is collected at exit)."""
    eng = SGLangEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0)
    list(eng.generate(PROMPTS[:1], SamplingParams(n=1, max_tokens=2, seed=0)))
    scheduler = eng.engine._scheduler
    assert scheduler is not None and not scheduler.done()  # waiting for the next request
    eng.close()
    assert scheduler.done()


def test_stop_strings_end_the_sample_as_vllm_does(engine: SGLangEngine, model_dir: Path) -> None:
    assert_stop_string_ends_the_sample(engine, model_dir)


def test_the_fake_reports_the_matched_stop_string_and_keeps_every_token(engine: SGLangEngine) -> None:
    """What SGLang returns for a stop string (schedule_batch.py ``Req.check_finished``), that the adapter relies on:
    finish {"type": "stop", "matched": <string>}, output_ids whole. PROMPTS[1]'s greedy text on the sharp tiny model
    is "000000000222": "02" completes at its 10th token."""
    sampling = {"max_new_tokens": 12, "temperature": 0.0, "stop": ["22", "02"]}
    (out,) = engine.engine.generate(input_ids=[PROMPTS[1]], sampling_params=[sampling], rid=["stop-string"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "02"} and len(out["output_ids"]) == 10


def test_stop_token_ends_the_sample_and_is_included(engine: SGLangEngine) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    (free,) = engine.generate(PROMPTS[1:2], greedy)
    stop = next(t for t in free.token_ids[1:] if t != EOS)
    (stopped,) = engine.generate(PROMPTS[1:2], dataclasses.replace(greedy, stop_token_ids=(stop,)))
    cut = free.token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)


def test_should_abort_aborts_the_unfinished_items(engine: SGLangEngine) -> None:
    params = SamplingParams(n=2, max_tokens=40, seed=0, ignore_eos=True)  # nothing finishes before step 40
    seen = list(engine.generate(PROMPTS, params, should_abort=lambda: len(engine.engine.steps) >= 1))
    assert len(by_key(seen)) == 6
    assert all(c.finish_reason == "abort" and len(c.token_ids) == len(c.logprobs) < 40 for c in seen)
    assert len(engine.engine.tokenizer_manager.aborted) == 6 and engine.engine.running == 0


def test_a_consumer_that_stops_early_leaves_nothing_running(engine: SGLangEngine) -> None:
    stream = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=0))
    next(stream)
    stream.close()
    assert len(engine.engine.tokenizer_manager.aborted) == 5


def test_options_the_adapter_sets_are_refused(fake, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="custom_weight_loader"):
        SGLangEngine(str(model_dir), dtype="float32", custom_weight_loader=["x.y"])


def test_without_sglang_the_error_says_what_to_install(monkeypatch, model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'relayrl[sglang]' (that is sglang>=0.5.23,<0.6)")):
        SGLangEngine(str(model_dir))


def test_load_weights_changes_what_is_generated(engine: SGLangEngine, model_dir: Path) -> None:
    weights, trained = new_weights(model_dir)
    engine.load_weights(weights.items())
    assert engine.engine.cache_flushes == 1 and not engine.engine._session
    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=1)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 0.8)


def test_load_weights_refuses_unknown_names_and_shapes_before_loading(engine: SGLangEngine) -> None:
    with pytest.raises(ValueError, match="nope: no such parameter"):
        engine.load_weights([("model.norm.weight", torch.ones(64)), ("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("model.norm.weight: shape")):
        engine.load_weights([("model.norm.weight", torch.ones(3))])
    assert engine.engine.model.loaded_names == []


def test_named_weights_are_not_available(engine: SGLangEngine, model_dir: Path) -> None:
    with pytest.raises(NotImplementedError, match=re.escape("docs/engines.md")):
        dict(engine.named_weights())
    assert engine.weight_specs() == [(n, tuple(p.shape), p.dtype) for n, p in load(model_dir).named_parameters()]


def test_broadcast_update_through_the_rollout_worker(engine: SGLangEngine, model_dir: Path) -> None:
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    weights, trained = new_weights(model_dir)
    name = group_name()
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 2, group_name=name, backend="gloo", timeout_s=30) as trainer:
        worker.init_weight_sync(
            rollout_pb2.InitWeightSyncRequest(
                master_address="127.0.0.1",
                master_port=trainer.port,
                rank=1,
                world_size=2,
                group_name=name,
                backend="gloo",
                timeout_s=30,
            )
        )
        manifest = sync_manifest(weights)
        join = send_in_background(trainer, manifest, weights)
        response = worker.update_weights(
            rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(), group_name=name)
        )
        join()
        worker.group.close()
    assert (response.policy_version, response.checksum) == (1, manifest.checksum)
    assert worker.stats(with_checksum=True).weights_checksum == manifest.checksum
    assert engine.engine.cache_flushes == 1 and os.listdir(engine._receipts) == []
    assert adapter._RECEIVERS[0].group.rank == 1
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 1.0)


def test_filesystem_update_is_read_inside_the_schedulers(engine: SGLangEngine, model_dir: Path, tmp_path) -> None:
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    weights, trained = new_weights(model_dir, seed=4)
    manifest = sync_manifest(weights, version=3, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    manifest = dataclasses.replace(manifest, path=str(tmp_path.resolve()))
    response = worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    assert (response.policy_version, response.checksum) == (3, manifest.checksum)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 1.0)


def test_tensor_parallel_schedulers_join_as_consecutive_ranks(fake, model_dir: Path) -> None:
    eng = SGLangEngine(str(model_dir), dtype="float32", seed=0, tp_size=2)
    assert eng.weight_sync_ranks == 2
    weights, _ = new_weights(model_dir)
    name = group_name()
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, group_name=name, backend="gloo", timeout_s=30) as trainer:
        group = eng.init_weight_sync(GroupArgs("127.0.0.1", trainer.port, 1, 3, name, "gloo", 30.0))
        manifest = sync_manifest(weights)
        join = send_in_background(trainer, manifest, weights)
        stats = eng.receive_update(manifest)
        join()
        group.close()
        assert [adapter._RECEIVERS[r].group.rank for r in range(2)] == [1, 2]
    assert stats.nbytes == manifest.total_bytes and eng.loaded_checksum() == manifest.checksum
    assert sorted(eng.engine.model.loaded_names) == sorted(list(weights) * 2)  # loaded on both ranks
    worker = RolloutWorker(eng, "tp", mode="pause", limits=GenerationLimits())
    request = rollout_pb2.InitWeightSyncRequest(
        master_address="127.0.0.1", master_port=1, rank=1, world_size=3, group_name="x", backend="gloo"
    )
    with pytest.raises(FailedPrecondition, match="spans 2 group ranks"):
        worker.init_weight_sync(request)
    eng.close()


def test_a_failed_load_is_reported_and_leaves_no_checksum(engine: SGLangEngine, model_dir: Path, tmp_path) -> None:
    weights, _ = new_weights(model_dir)
    manifest = sync_manifest(weights, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    with pytest.raises(FailedPrecondition, match="engine rank 0"):
        engine.receive_update(dataclasses.replace(manifest, path=str(tmp_path / "elsewhere")))
    assert engine.loaded_checksum() == "" and not engine.engine._session


def test_shadow_mode_is_refused(engine: SGLangEngine) -> None:
    with pytest.raises(ValueError, match="supports 'pause' only"):
        RolloutWorker(engine, "w0", mode="shadow", limits=GenerationLimits())


# -- the API surface recorded in docs/engines.md -------------------------------------------------------------
def test_the_fake_and_the_adapter_keep_to_the_documented_api(fake, model_dir: Path, tmp_path, monkeypatch) -> None:
    docs = documented("sglang.")
    targets = {
        "sglang.Engine": accepted(fake_sglang.Engine, fake_sglang.SERVER_ARGS),
        "sglang.Engine.async_generate": accepted(fake_sglang.Engine.async_generate),
        "sglang.SamplingParams": set(fake_sglang.SAMPLING_FIELDS),
        "sglang.Engine.update_weights_from_tensor": accepted(fake_sglang.Engine.update_weights_from_tensor),
        "sglang.TokenizerManager.abort_request": accepted(fake_sglang.TokenizerManager.abort_request),
    }
    assert set(docs) == set(targets)
    for name, names in targets.items():
        assert docs[name] <= names, f"{name}: the fake lacks {docs[name] - names}"

    used: dict[str, set[str]] = {}
    for owner, attr, key in [
        (fake_sglang.Engine, "async_generate", "sglang.Engine.async_generate"),
        (fake_sglang.Engine, "update_weights_from_tensor", "sglang.Engine.update_weights_from_tensor"),
        (fake_sglang.TokenizerManager, "abort_request", "sglang.TokenizerManager.abort_request"),
        (fake_sglang, "Engine", "sglang.Engine"),
    ]:
        record(monkeypatch, owner, attr, key, used)
    eng = SGLangEngine(str(model_dir), dtype="float32", seed=0, tp_size=1, mem_fraction_static=0.5)
    list(eng.generate(PROMPTS, SamplingParams(n=2, max_tokens=3, seed=0), should_abort=lambda: True))
    weights, _ = new_weights(model_dir)
    eng.load_weights(weights.items())
    manifest = sync_manifest(weights, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    eng.receive_update(dataclasses.replace(manifest, path=str(tmp_path.resolve())))
    used["sglang.SamplingParams"] = {
        key for call in eng.engine.generate_calls for p in call["sampling_params"] for key in p
    }
    eng.close()
    assert set(used) == set(docs)
    for name, names in used.items():
        assert names <= docs[name], f"{name}: the adapter passes {names - docs[name]}, not in docs/engines.md"


def test_a_group_that_cannot_be_joined_fails_the_update_not_the_scheduler(engine: SGLangEngine, model_dir) -> None:
    weights, _ = new_weights(model_dir)
    engine.init_weight_sync(GroupArgs("127.0.0.1", free_port(), 1, 2, group_name(), "gloo", 1.0))
    with pytest.raises(WeightSyncError, match="engine rank 0"):
        engine.receive_update(sync_manifest(weights))
    assert engine.loaded_checksum() == "" and not engine.engine._session
    assert len(list(engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=2)))) == len(PROMPTS)


def test_an_update_the_model_did_not_apply_is_caught(engine: SGLangEngine, model_dir: Path, tmp_path, monkeypatch):
    """The checksum covers what the engine's parameters hold after load_weights, not the bytes received: a
    loader that silently drops a tensor fails the update naming it."""
    original = FakeEngineModel.load_weights

    def drops_the_norm(self, weights):
        return original(self, [(name, t) for name, t in weights if name != "model.norm.weight"])

    monkeypatch.setattr(FakeEngineModel, "load_weights", drops_the_norm)
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    weights, _ = new_weights(model_dir, seed=6)
    manifest = sync_manifest(weights, version=2, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    manifest = dataclasses.replace(manifest, path=str(tmp_path.resolve()))
    with pytest.raises(FailedPrecondition, match=re.escape("model.norm.weight: the engine's parameters do not hold")):
        worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    assert worker.reported_version == -1 and engine.loaded_checksum() == ""
