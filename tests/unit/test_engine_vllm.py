"""The vllm engine adapter, driven through the fake ``vllm`` module (tests/fakes/fake_vllm.py) on the
tiny model: logprobs as the trainer computes them, finish reasons, n samples, the arguments vLLM receives,
abort, loading weights directly and through the rollout worker's weight sync, and the fake's API surface
against the one recorded in docs/engines.md."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testing import (
    EOS,
    PROMPTS,
    accepted,
    assert_trainer_logprobs,
    by_key,
    documented,
    load,
    new_weights,
    recompute,
    record,
    send_in_background,
    sharp_tiny_model,
    sync_manifest,
)
from fakes import fake_vllm

from relayrl.errors import FailedPrecondition, InvalidArgument
from relayrl.rollout.engine import EngineCompletion, create_engine, engine_class
from relayrl.rollout.external import SUPPORTED_VERSIONS, GroupArgs
from relayrl.rollout.sampling import GenerationLimits, SamplingParams
from relayrl.rollout.vllm import EXTENSION, VLLMEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.group import WeightBroadcastGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    for name in fake_vllm.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_vllm)
    return fake_vllm


@pytest.fixture
def engine(fake, model_dir: Path):
    eng = VLLMEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0)
    yield eng
    eng.close()


def test_registered_and_created_by_name(fake, model_dir: Path) -> None:
    assert engine_class("vllm") is VLLMEngine
    eng = create_engine("vllm", model_path=str(model_dir), dtype="float32", max_batch_size=4, seed=0)
    assert (eng.name, eng.vocab_size, eng.max_model_len, eng.eos_token_ids) == ("vllm", 23, 64, frozenset({EOS}))
    assert eng.receives_weights_itself and eng.weight_sync_ranks == 1


def test_generate_n_samples_with_the_trainers_logprobs(engine: VLLMEngine, model_dir: Path) -> None:
    params = SamplingParams(n=3, temperature=0.7, top_p=1.0, max_tokens=12, seed=7)
    completions = by_key(list(engine.generate(PROMPTS, params)))
    assert set(completions) == {(p, s) for p in range(len(PROMPTS)) for s in range(3)}
    for c in completions.values():
        assert len(c.logprobs) == len(c.token_ids) > 0
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == params.max_tokens
    assert_trainer_logprobs(load(model_dir), PROMPTS, completions, params.temperature)


def test_greedy_logprobs_are_at_temperature_one(engine: VLLMEngine, model_dir: Path) -> None:
    completions = by_key(list(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=8))))
    for p in range(len(PROMPTS)):
        assert completions[p, 0].token_ids == completions[p, 1].token_ids
    assert_trainer_logprobs(load(model_dir), PROMPTS, completions, 1.0)


def test_settings_whose_logprobs_are_not_the_trainers_are_refused(engine: VLLMEngine, model_dir: Path) -> None:
    """vLLM's processed logprobs are renormalised over the top-p nucleus and after the min-tokens mask (the fake
    does as vllm/v1/sample/sampler.py): relayrl refuses those settings rather than train on other logprobs."""
    params = SamplingParams(n=2, temperature=1.0, top_p=0.5, max_tokens=8, seed=3)
    with pytest.raises(InvalidArgument, match=r"^params.top_p: the vllm engine reports logprobs renormalised"):
        list(engine.generate(PROMPTS, params))
    with pytest.raises(InvalidArgument, match=r"^params.min_tokens: the vllm engine"):
        list(engine.generate(PROMPTS, dataclasses.replace(params, top_p=1.0, min_tokens=2)))
    with pytest.raises(InvalidArgument, match=r"^params.temperature: the vllm engine takes at most 2.0"):
        list(engine.generate(PROMPTS, dataclasses.replace(params, top_p=1.0, temperature=2.5)))
    assert engine.llm.llm_engine.added == []
    # what the refusal guards against: the fake, as vLLM, returns other logprobs under top-p
    direct = fake_vllm.SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8, seed=3, logprobs=0)
    direct.output_kind = fake_vllm.RequestOutputKind.FINAL_ONLY
    engine.llm.llm_engine.add_request("direct", fake_vllm.TokensPrompt(prompt_token_ids=PROMPTS[1]), direct)
    (output,) = engine.llm.llm_engine.step()
    got = [lp[t].logprob for t, lp in zip(output.outputs[0].token_ids, output.outputs[0].logprobs, strict=True)]
    expected = recompute(load(model_dir), PROMPTS[1], output.outputs[0].token_ids, 1.0)
    assert max(g - e for g, e in zip(got, expected, strict=True)) > 0.01


def test_ignore_eos_runs_every_sample_to_max_tokens(engine: VLLMEngine, model_dir: Path) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    completions = by_key(list(engine.generate(PROMPTS, params)))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in completions.values())
    assert_trainer_logprobs(load(model_dir), PROMPTS, completions, 1.0)


def test_the_fakes_sampling_params_apply_vllms_rules() -> None:
    assert fake_vllm.SamplingParams(temperature=0.001).temperature == fake_vllm.MAX_TEMP
    greedy = fake_vllm.SamplingParams(temperature=0.0, top_p=0.3, seed=-1, stop_token_ids=[5, 5, 9])
    assert (greedy.top_p, greedy.seed, greedy.stop_token_ids) == (1.0, None, [5, 9])
    for bad in ({"temperature": 2.5}, {"top_p": 0.0}, {"min_tokens": 5, "max_tokens": 4}, {"max_tokens": 0}):
        with pytest.raises(fake_vllm.VLLMValidationError):
            fake_vllm.SamplingParams(**bad)


def test_an_unsupported_vllm_version_is_refused_naming_the_range(fake, model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(fake_vllm, "__version__", "0.11.0")
    with pytest.raises(ImportError, match=re.escape("supports vllm>=0.33.0,<0.34, found 0.11.0")):
        VLLMEngine(str(model_dir), dtype="float32")


def test_the_extras_pin_the_checked_ranges() -> None:
    """pyproject's vllm/sglang extras admit exactly the versions the adapters were read against."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    for package, supported in SUPPORTED_VERSIONS.items():
        assert re.findall(rf"^{package} = \[(.*)\]", pyproject, flags=re.M) == [f'"{package}{supported}"']


def test_arguments_reach_vllm_as_documented(engine: VLLMEngine, model_dir: Path, monkeypatch) -> None:
    llm = engine.llm
    assert llm.init_kwargs == {
        "model": str(model_dir),
        "tensor_parallel_size": 1,
        "dtype": "float32",
        "seed": 0,
        "gpu_memory_utilization": 0.92,
        "max_num_seqs": 8,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    }
    made: list[dict[str, Any]] = []
    original = fake_vllm.SamplingParams
    monkeypatch.setattr(fake_vllm, "SamplingParams", lambda **kw: made.append(kw) or original(**kw))
    params = SamplingParams(n=2, temperature=0.5, top_p=1.0, max_tokens=4, stop_token_ids=(5, 9), seed=11)
    list(engine.generate(PROMPTS[:2], params))
    assert made == [
        {
            "n": 1,
            "temperature": 0.5,
            "top_p": 1.0,
            "max_tokens": 4,
            "stop_token_ids": [5, 9],
            "ignore_eos": False,
            "seed": 11 + s,
            "logprobs": 0,
            "detokenize": False,
            "output_kind": fake_vllm.RequestOutputKind.FINAL_ONLY,
        }
        for _ in range(2)
        for s in range(2)
    ]
    added = llm.llm_engine.added
    assert [prompt for _, prompt, _ in added] == [{"prompt_token_ids": PROMPTS[p]} for p in range(2) for _ in range(2)]
    assert len({request_id for request_id, _, _ in added}) == 4
    list(engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=2, seed=None)))
    assert [kw["seed"] for kw in made[4:]] == [None, None]


def test_stop_token_ends_the_sample_and_is_included(engine: VLLMEngine) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    (free,) = engine.generate(PROMPTS[1:2], greedy)
    stop = next(t for t in free.token_ids[1:] if t != EOS)
    (stopped,) = engine.generate(PROMPTS[1:2], dataclasses.replace(greedy, stop_token_ids=(stop,)))
    cut = free.token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)


def test_should_abort_aborts_the_unfinished_requests(engine: VLLMEngine) -> None:
    seen: list[EngineCompletion] = []
    for c in engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=0), should_abort=lambda: bool(seen)):
        seen.append(c)
    completions = by_key(seen)
    assert len(completions) == 6
    aborted = [c for c in seen if c.finish_reason == "abort"]
    assert len(aborted) == 5 and all(c.token_ids == [] == c.logprobs for c in aborted)
    assert len(engine.llm.llm_engine.aborted) == 5 and not engine.llm.llm_engine.has_unfinished_requests()


def test_a_consumer_that_stops_early_leaves_nothing_running(engine: VLLMEngine) -> None:
    stream = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=0))
    next(stream)
    stream.close()
    assert len(engine.llm.llm_engine.aborted) == 5 and not engine.llm.llm_engine.has_unfinished_requests()


def test_options_the_adapter_sets_are_refused(fake, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMEngine(str(model_dir), dtype="float32", logprobs_mode="raw_logprobs")


def test_without_vllm_the_error_says_what_to_install(monkeypatch, model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'relayrl[vllm]' (that is vllm>=0.33.0,<0.34)")):
        VLLMEngine(str(model_dir))


def test_load_weights_changes_what_is_generated(engine: VLLMEngine, model_dir: Path) -> None:
    weights, trained = new_weights(model_dir)
    engine.load_weights(weights.items())
    assert engine.llm.prefix_cache_resets == 1 and "relayrl_load_weights" in engine.llm.rpc_calls
    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=1)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 0.8)


def test_load_weights_refuses_unknown_names_and_shapes_before_loading(engine: VLLMEngine) -> None:
    model = engine.llm.workers[0].model_runner.get_model()
    with pytest.raises(ValueError, match="nope: no such parameter"):
        engine.load_weights([("model.norm.weight", torch.ones(64)), ("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("model.norm.weight: shape")):
        engine.load_weights([("model.norm.weight", torch.ones(3))])
    assert model.loaded_names == []


def test_named_weights_are_worker_zeros_parameters(engine: VLLMEngine, model_dir: Path) -> None:
    reference = dict(load(model_dir).named_parameters())
    named = dict(engine.named_weights())
    assert set(named) == set(reference)
    for name, tensor in named.items():
        assert tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, reference[name].detach())


def test_weight_specs_are_the_checkpoints(engine: VLLMEngine, model_dir: Path) -> None:
    assert engine.weight_specs() == [(n, tuple(p.shape), p.dtype) for n, p in load(model_dir).named_parameters()]


def test_broadcast_update_through_the_rollout_worker(engine: VLLMEngine, model_dir: Path) -> None:
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    weights, trained = new_weights(model_dir)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 2, group_name="g1", backend="gloo", timeout_s=30) as trainer:
        worker.init_weight_sync(
            rollout_pb2.InitWeightSyncRequest(
                master_address="127.0.0.1",
                master_port=trainer.port,
                rank=1,
                world_size=2,
                group_name="g1",
                backend="gloo",
                timeout_s=30,
            )
        )
        assert worker.group.group_name == "g1" and "relayrl_init_weight_sync" in engine.llm.rpc_calls
        manifest = sync_manifest(weights)
        assert len(manifest.buckets) > 2
        join = send_in_background(trainer, manifest, weights)
        response = worker.update_weights(
            rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(), group_name="g1")
        )
        join()
        worker.group.close()
    assert (response.policy_version, response.checksum) == (1, manifest.checksum)
    assert worker.stats(with_checksum=True).weights_checksum == manifest.checksum
    assert engine.llm.prefix_cache_resets == 1
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 1.0)


def test_filesystem_update_is_read_inside_the_workers(engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    weights, trained = new_weights(model_dir, seed=4)
    manifest = sync_manifest(weights, version=3, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    manifest = dataclasses.replace(manifest, path=str(tmp_path.resolve()))
    response = worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    assert (response.policy_version, response.checksum) == (3, manifest.checksum)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(engine.generate(PROMPTS, params))), 1.0)


def test_tensor_parallel_workers_join_as_consecutive_ranks(fake, model_dir: Path) -> None:
    eng = VLLMEngine(str(model_dir), dtype="float32", seed=0, tensor_parallel_size=2)
    assert eng.weight_sync_ranks == 2
    weights, _ = new_weights(model_dir)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, group_name="tp", backend="gloo", timeout_s=30) as trainer:
        group = eng.init_weight_sync(GroupArgs("127.0.0.1", trainer.port, 1, 3, "tp", "gloo", 30.0))
        assert [w.relayrl_receiver.group.rank for w in eng.llm.workers] == [1, 2]
        manifest = sync_manifest(weights)
        join = send_in_background(trainer, manifest, weights)
        stats = eng.receive_update(manifest)
        join()
        group.close()
    assert stats.nbytes == manifest.total_bytes and eng.loaded_checksum() == manifest.checksum
    loaded = eng.llm.workers[0].model_runner.get_model().loaded_names
    assert sorted(loaded) == sorted(list(weights) * 2)  # every tensor loaded by both workers
    worker = RolloutWorker(eng, "tp", mode="pause", limits=GenerationLimits())
    request = rollout_pb2.InitWeightSyncRequest(
        master_address="127.0.0.1", master_port=1, rank=1, world_size=3, group_name="x", backend="gloo"
    )
    with pytest.raises(FailedPrecondition, match="spans 2 group ranks"):
        worker.init_weight_sync(request)


def test_a_failed_load_is_reported_and_leaves_no_checksum(engine: VLLMEngine, model_dir: Path, tmp_path) -> None:
    weights, _ = new_weights(model_dir)
    manifest = sync_manifest(weights, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    wrong = dataclasses.replace(manifest, path=str(tmp_path / "elsewhere"))
    with pytest.raises(FailedPrecondition, match="engine rank 0"):
        engine.receive_update(wrong)
    assert engine.loaded_checksum() == ""


def test_shadow_mode_is_refused(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="supports 'pause' only"):
        RolloutWorker(engine, "w0", mode="shadow", limits=GenerationLimits())


# -- the API surface recorded in docs/engines.md -------------------------------------------------------------
def test_the_fake_and_the_adapter_keep_to_the_documented_api(fake, model_dir: Path, tmp_path, monkeypatch) -> None:
    docs = documented("vllm.")
    targets = {
        "vllm.LLM": (fake_vllm.LLM, fake_vllm.ENGINE_ARGS),
        "vllm.SamplingParams": (fake_vllm.SamplingParams, frozenset()),
        "vllm.TokensPrompt": (fake_vllm.TokensPrompt, frozenset()),
        "vllm.LLM.collective_rpc": (fake_vllm.LLM.collective_rpc, frozenset()),
        "vllm.LLM.get_world_size": (fake_vllm.LLM.get_world_size, frozenset()),
        "vllm.LLMEngine.add_request": (fake_vllm.LLMEngine.add_request, frozenset()),
        "vllm.LLMEngine.abort_request": (fake_vllm.LLMEngine.abort_request, frozenset()),
    }
    assert set(docs) == set(targets)
    for name, (obj, extra) in targets.items():
        assert docs[name] <= accepted(obj, extra), f"{name}: the fake lacks {docs[name] - accepted(obj, extra)}"

    used: dict[str, set[str]] = {}
    for owner, attr, key in [
        (fake_vllm.LLM, "collective_rpc", "vllm.LLM.collective_rpc"),
        (fake_vllm.LLM, "get_world_size", "vllm.LLM.get_world_size"),
        (fake_vllm.LLMEngine, "add_request", "vllm.LLMEngine.add_request"),
        (fake_vllm.LLMEngine, "abort_request", "vllm.LLMEngine.abort_request"),
        (fake_vllm, "LLM", "vllm.LLM"),
        (fake_vllm, "SamplingParams", "vllm.SamplingParams"),
        (fake_vllm, "TokensPrompt", "vllm.TokensPrompt"),
    ]:
        record(monkeypatch, owner, attr, key, used)
    eng = VLLMEngine(str(model_dir), dtype="float32", seed=0, tensor_parallel_size=1, gpu_memory_utilization=0.5)
    list(eng.generate(PROMPTS, SamplingParams(n=2, max_tokens=3, seed=0), should_abort=lambda: True))
    weights, _ = new_weights(model_dir)
    eng.load_weights(weights.items())
    manifest = sync_manifest(weights, transport="filesystem")
    write_weights(tmp_path, manifest, weights)
    eng.receive_update(dataclasses.replace(manifest, path=str(tmp_path.resolve())))
    eng.close()
    assert set(used) == set(docs)
    for name, names in used.items():
        assert names <= docs[name], f"{name}: the adapter passes {names - docs[name]}, not in docs/engines.md"
