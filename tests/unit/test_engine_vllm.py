"""The vllm engine adapter, driven through the fake ``vllm`` module (tests/fakes/fake_vllm.py) on the
tiny model: logprobs as the trainer computes them, finish reasons, n samples, the arguments vLLM receives,
abort, loading weights directly and through the rollout worker's weight sync, and the fake's API surface
against the one recorded in docs/engines.md."""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import Any

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
    recompute,
    record,
    send_in_background,
    sharp_tiny_model,
    sync_manifest,
)
from fakes import fake_vllm

from relayrl.errors import FailedPrecondition, InvalidArgument
from relayrl.rollout.engine import create_engine, engine_class
from relayrl.rollout.external import SUPPORTED_VERSIONS, GroupArgs
from relayrl.rollout.vllm import EXTENSION, VLLMEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.fingerprint import manifest_fingerprint, phase_for
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.wire.sampling import GenerationLimits, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    for name in fake_vllm.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_vllm)
    return fake_vllm


@pytest.fixture(scope="module")
def shared_engine(model_dir: Path):
    """One engine (one engine-core process) for the module's tests; ``engine`` resets it around each test."""
    with pytest.MonkeyPatch.context() as patch:
        for name in fake_vllm.MODULES:
            patch.setitem(sys.modules, name, fake_vllm)
        eng = VLLMEngine(str(model_dir), dtype="float32", max_batch_size=8, seed=0)
    yield eng
    eng.close()


@pytest.fixture
def engine(fake, shared_engine: VLLMEngine, model_dir: Path):
    """The shared engine with empty call logs, and the checkpoint's weights again after the test."""
    llm = shared_engine.llm
    for log in (llm.llm_engine.added, llm.llm_engine.aborted, llm.llm_engine.steps, llm.rpc_calls):
        log.clear()
    llm.prefix_cache_resets = 0
    yield shared_engine
    shared_engine.load_weights(load(model_dir).named_parameters())


def test_registered_and_created_by_name(fake, model_dir: Path) -> None:
    assert engine_class("vllm") is VLLMEngine
    eng = create_engine("vllm", model_path=str(model_dir), dtype="float32", max_batch_size=4, seed=0)
    assert (eng.name, eng.vocab_size, eng.max_model_len, eng.eos_token_ids) == ("vllm", 23, 64, frozenset({EOS}))
    assert eng.receives_weights_itself and eng.weight_sync_ranks == 1
    eng.close()
    assert eng.llm.llm_engine.engine_core.closed and not eng.llm.llm_engine.engine_core.process.is_alive()


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
    outputs = []
    while not outputs:
        outputs = engine.llm.llm_engine.step()
    (output,) = outputs
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
            "stop": [],
            "include_stop_str_in_output": False,
            "detokenize": False,
            "output_kind": fake_vllm.RequestOutputKind.FINAL_ONLY,
        }
        for _ in range(2)
        for s in range(2)
    ]
    added = llm.llm_engine.added
    salt = added[0][1]["cache_salt"]  # the policy version's (test_engine_vllm_turns.py)
    assert re.fullmatch(r"relayrl-v\d+", salt)
    expected = [{"prompt_token_ids": PROMPTS[p], "cache_salt": salt} for p in range(2) for _ in range(2)]
    assert [prompt for _, prompt, _ in added] == expected
    assert len({request_id for request_id, _, _ in added}) == 4
    list(engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=2, seed=None)))
    assert [kw["seed"] for kw in made[4:]] == [None, None]
    list(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, stop=("x",), include_stop_str_in_output=True)))
    assert {k: made[-1][k] for k in ("stop", "include_stop_str_in_output", "detokenize")} == {
        "stop": ["x"], "include_stop_str_in_output": True, "detokenize": True,  # vLLM refuses stop without detokenize
    }  # fmt: skip


def test_stop_strings_end_the_sample_as_vllm_does(engine: VLLMEngine, model_dir: Path) -> None:
    assert_stop_string_ends_the_sample(engine, model_dir)


def test_the_fake_cuts_its_text_at_a_stop_string_and_keeps_every_token(engine: VLLMEngine) -> None:
    """What vLLM returns for a stop string (vllm/v1/engine/detokenizer.py), that the adapter's token ids rely on:
    finish "stop", stop_reason the string, token_ids whole, the text cut before the string (after it with
    include_stop_str_in_output). PROMPTS[1]'s greedy text on the sharp tiny model is "000000000222"."""
    outputs = {}
    for include in (False, True):
        direct = fake_vllm.SamplingParams(
            temperature=0.0, max_tokens=12, stop=["02"], include_stop_str_in_output=include
        )
        direct.output_kind = fake_vllm.RequestOutputKind.FINAL_ONLY
        engine.llm.llm_engine.add_request(
            f"text-{include}", fake_vllm.TokensPrompt(prompt_token_ids=PROMPTS[1]), direct
        )
        done = []
        while not done:
            done = engine.llm.llm_engine.step()
        outputs[include] = done[0].outputs[0]
    for include, text in ((False, "00000000"), (True, "0000000002")):
        out = outputs[include]
        assert (out.finish_reason, out.stop_reason, out.text, len(out.token_ids)) == ("stop", "02", text, 10)


def test_stop_token_ends_the_sample_and_is_included(engine: VLLMEngine) -> None:
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    (free,) = engine.generate(PROMPTS[1:2], greedy)
    stop = next(t for t in free.token_ids[1:] if t != EOS)
    (stopped,) = engine.generate(PROMPTS[1:2], dataclasses.replace(greedy, stop_token_ids=(stop,)))
    cut = free.token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)


def test_should_abort_aborts_the_unfinished_requests(engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    llm_engine = engine.llm.llm_engine
    step = llm_engine.step

    def paced_step():  # 0.1 s a step, so the 50 ms poll of should_abort sees step 2 or 3 on any machine, not 6
        time.sleep(0.1)
        return step()

    monkeypatch.setattr(llm_engine, "step", paced_step)
    params = SamplingParams(n=2, max_tokens=6, seed=0, ignore_eos=True)  # nothing finishes before step 6
    seen = list(engine.generate(PROMPTS, params, should_abort=lambda: len(llm_engine.steps) >= 2))
    assert len(by_key(seen)) == 6
    assert all(c.finish_reason == "abort" and c.token_ids == [] == c.logprobs for c in seen)
    assert len(llm_engine.aborted) == 6 and not llm_engine.has_unfinished_requests()


def test_a_consumer_that_stops_early_leaves_nothing_running(engine: VLLMEngine) -> None:
    stream = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=0))
    first = next(stream)
    stream.close()
    requested = {request_id for request_id, _, _ in engine.llm.llm_engine.added}
    assert first.finish_reason in ("stop", "length") and set(engine.llm.llm_engine.aborted) <= requested
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_concurrent_calls_share_engine_steps(engine: VLLMEngine, model_dir: Path) -> None:
    """Four generate calls from four threads: every call gets exactly its samples, with the trainer's logprobs,
    and the engine ran requests of different calls in the same step (continuous batching across calls)."""
    assert_concurrent_calls_exact(engine, model_dir)
    calls_per_step = [len({request_id.split("-")[1] for request_id in step}) for step in engine.llm.llm_engine.steps]
    assert max(calls_per_step) > 1


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
    before = engine.llm.fake_probe("loaded_names")
    with pytest.raises(ValueError, match="nope: no such parameter"):
        engine.load_weights([("model.norm.weight", torch.ones(64)), ("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("model.norm.weight: shape")):
        engine.load_weights([("model.norm.weight", torch.ones(3))])
    assert engine.llm.fake_probe("loaded_names") == before


def test_named_weights_are_worker_zeros_fused_parameters(engine: VLLMEngine, model_dir: Path) -> None:
    """vLLM's names and layout (fused q/k/v and gate/up, vocabulary padded to 64 rows), across the process."""
    reference = {name: p.detach() for name, p in load(model_dir).named_parameters()}
    named = dict(engine.named_weights())
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert f"{attn}qkv_proj.weight" in named and f"{attn}q_proj.weight" not in named and "lm_head.weight" not in named
    fused_qkv = torch.cat([reference[f"{attn}{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(named[f"{attn}qkv_proj.weight"], fused_qkv, rtol=0, atol=0)
    fused_gate_up = torch.cat([reference[f"{mlp}gate_proj.weight"], reference[f"{mlp}up_proj.weight"]])
    torch.testing.assert_close(named[f"{mlp}gate_up_proj.weight"], fused_gate_up, rtol=0, atol=0)
    embed = named["model.embed_tokens.weight"]
    assert embed.shape == (64, reference["model.embed_tokens.weight"].shape[1])
    torch.testing.assert_close(embed[:23], reference["model.embed_tokens.weight"], rtol=0, atol=0)


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
    weights, trained = new_weights(model_dir)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, group_name="tp", backend="gloo", timeout_s=30) as trainer:
        group = eng.init_weight_sync(GroupArgs("127.0.0.1", trainer.port, 1, 3, "tp", "gloo", 30.0))
        assert eng.llm.fake_probe("group_ranks") == [1, 2]
        manifest = sync_manifest(weights)
        join = send_in_background(trainer, manifest, weights)
        stats = eng.receive_update(manifest)
        join()
        group.close()
    assert stats.nbytes == manifest.total_bytes and eng.loaded_checksum() == manifest.checksum
    assert [sorted(names) for names in eng.llm.fake_probe("loaded_names")] == [sorted(weights)] * 2
    worker = RolloutWorker(eng, "tp", mode="pause", limits=GenerationLimits())
    request = rollout_pb2.InitWeightSyncRequest(
        master_address="127.0.0.1", master_port=1, rank=1, world_size=3, group_name="x", backend="gloo"
    )
    with pytest.raises(FailedPrecondition, match="spans 2 group ranks"):
        worker.init_weight_sync(request)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8)  # generated from the two ranks' shards
    assert_trainer_logprobs(trained, PROMPTS, by_key(list(eng.generate(PROMPTS, params))), 1.0)
    eng.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sampled_update_reports_the_senders_sampled_fingerprint(fake, model_dir: Path, tp: int) -> None:
    """verify: sampled (the default) in band: the engine's workers fold what lands and compare it with the
    sender's; the checksum they report is the sampled value of the tensors they applied (tp 1: read back
    from the model, tp 2: from the received tensors, each found applied), as the trainer expects."""
    eng = VLLMEngine(str(model_dir), dtype="float32", seed=0, tensor_parallel_size=tp)
    weights, _ = new_weights(model_dir, seed=5)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, tp + 1, group_name="s", backend="gloo", timeout_s=30) as trainer:
        group = eng.init_weight_sync(GroupArgs("127.0.0.1", trainer.port, 1, tp + 1, "s", "gloo", 30.0))
        manifest = sync_manifest(weights).with_header(
            version=1, verify="sampled", sample_stride=4, sample_phase=phase_for(1, 4)
        )
        join = send_in_background(trainer, manifest, weights)
        eng.receive_update(manifest)
        join()
        group.close()
    assert eng.loaded_checksum() == manifest_fingerprint(manifest, list(weights.items()))
    assert eng.loaded_checksum().startswith("fs:")
    eng.close()


def test_the_fake_passes_rpc_arguments_and_results_as_vllms_msgpack_does() -> None:
    """vllm/v1/serial_utils.py without type information: a tensor arrives as [dtype, shape, data] (its bytes
    only when below 256, else an out-of-band buffer index whose bytes an untyped decode never reads)."""
    small, large = torch.arange(4, dtype=torch.float32), torch.zeros(100)
    assert fake_vllm.msgpack_roundtrip((small, ("a", 1))) == [["float32", [4], small.numpy().tobytes()], ["a", 1]]
    assert fake_vllm.msgpack_roundtrip([large]) == [["float32", [100], 1]]
    with pytest.raises(TypeError, match="is not serializable"):
        fake_vllm.msgpack_roundtrip(object())


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
