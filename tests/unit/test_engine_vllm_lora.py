"""LoRA on the vllm adapter, through the fake ``vllm`` (tests/fakes/fake_vllm.py), whose workers load adapters as
vLLM's LoRA managers do (PEFT directories; alpha / r folded into ``lora_B`` in place; an id kept unless
``load_inplace``; modules outside the model silently unmatched) and whose prefix cache is keyed by adapter name
and path. Each test shows one trap and the adapter's handling of it."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from engine_testing import PROMPTS, load, recompute, sharp_tiny_model
from fakes import fake_vllm
from safetensors.torch import save_file

from relayrl.rollout import vllm as adapter
from relayrl.rollout.vllm import VLLMEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.manifest import build_manifest
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import GenerationLimits, SamplingParams

SPEC = LoraAdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    for name in fake_vllm.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_vllm)
    eng = VLLMEngine(
        str(model_dir), dtype="float32", max_batch_size=8, seed=0, block_size=4, enable_lora=True, max_lora_rank=8
    )
    yield eng
    eng.close()


def adapter_tensors(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """A random adapter on every q_proj and v_proj, under PEFT's saved names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in load(model_dir).named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out_features, in_features = module.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(SPEC.rank, in_features, generator=generator)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(
                out_features, SPEC.rank, generator=generator
            )
    return tensors


def adapted_model(model_dir: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The trainer's view: W + scale * B A on each adapted module."""
    model = load(model_dir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                params[f"{module}.weight"].add_(SPEC.scale * b @ a)
    return model


def assert_served(engine: VLLMEngine, model: torch.nn.Module) -> None:
    for c in engine.generate(PROMPTS, PARAMS):
        expected = recompute(model, PROMPTS[c.prompt_index], c.token_ids, PARAMS.temperature)
        assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_the_adapter_is_served_with_the_trainers_logprobs_and_reloading_it_scales_once(
    engine: VLLMEngine, model_dir: Path
) -> None:
    """vLLM folds alpha / r into ``lora_B`` in place (``LoRALayerWeights.optimize``): handed the same tensors
    twice, it scales them twice (SkyRL #2250; the fake does so, below). The adapter stages files, which vLLM reads
    afresh: the same tensors loaded as a second version serve the same model, and the caller's are untouched."""
    tensors = adapter_tensors(model_dir, seed=1)
    sent = copy.deepcopy(tensors)
    modules = len(tensors) // 2  # every layer's q_proj and v_proj
    assert engine.load_adapter("policy-v1", SPEC, tensors) == modules
    assert_served(engine, adapted_model(model_dir, sent))
    assert engine.load_adapter("policy-v2", SPEC, tensors) == modules
    assert_served(engine, adapted_model(model_dir, sent))
    assert all(torch.equal(tensors[n], sent[n]) for n in sent)
    config = {"r": SPEC.rank, "lora_alpha": SPEC.alpha}
    shared = fake_vllm.LoRAModel.from_lora_tensors(1, tensors, config)  # what a tensor path shares with its caller
    fake_vllm.LoRAModelManager(list(shared.loras)).add_adapter(shared)
    fake_vllm.LoRAModelManager(list(shared.loras)).add_adapter(
        fake_vllm.LoRAModel.from_lora_tensors(2, tensors, config)
    )
    name = next(n for n in tensors if ".lora_B." in n)
    assert torch.allclose(tensors[name], sent[name] * SPEC.scale**2)


def test_every_version_has_its_own_name_id_and_path(engine: VLLMEngine, model_dir: Path) -> None:
    """vLLM keys its prefix cache by adapter name and path (``_gen_lora_extra_hash_keys``) and keeps an adapter
    id it already has unless the request says ``load_inplace``, which then reloads it at every step. Each version
    is a new name, id and path: version 2 is loaded once, its requests never reuse version 1's KV, and the
    versions before the previous one are removed with their files."""
    engine.load_adapter("policy-v1", SPEC, adapter_tensors(model_dir, seed=1))
    list(engine.generate(PROMPTS[1:2], PARAMS))
    engine.load_adapter("policy-v2", SPEC, adapter_tensors(model_dir, seed=2))
    list(engine.generate(PROMPTS[1:2], PARAMS))
    admissions = engine.llm.fake_probe("admissions")
    request_id = engine.llm.llm_engine.added[-PARAMS.n][0]  # the first of the call
    assert admissions[request_id][1:] == [0, False]  # nothing of version 1's KV
    assert engine.llm.fake_probe("lora_loads") == [2]  # once per version, not once per step
    first = engine._adapters[0]
    engine.load_adapter("policy-v3", SPEC, adapter_tensors(model_dir, seed=3))
    assert engine.llm.llm_engine.list_loras() == {2, 3} and not os.path.exists(first.lora_path)
    # the traps, on the fake directly: new weights under a reused name and path need load_inplace, which then
    # reloads them at every step, and their requests are served the KV the old weights computed
    latest = engine._adapters[-1]
    final = fake_vllm.SamplingParams(max_tokens=4, output_kind=fake_vllm.RequestOutputKind.FINAL_ONLY)
    llm_engine = engine.llm.llm_engine

    def run(request_id: str, lora: fake_vllm.LoRARequest) -> None:
        prompt = fake_vllm.TokensPrompt(prompt_token_ids=PROMPTS[1])
        llm_engine.add_request(request_id, prompt, final, lora_request=lora)
        while llm_engine.has_unfinished_requests():
            llm_engine.step()

    run("old", fake_vllm.LoRARequest(latest.lora_name, latest.lora_int_id, latest.lora_path))
    save_file(adapter_tensors(model_dir, seed=9), os.path.join(latest.lora_path, "adapter_model.safetensors"))
    loads = engine.llm.fake_probe("lora_loads")[0]
    run("reused", fake_vllm.LoRARequest(latest.lora_name, latest.lora_int_id, latest.lora_path, load_inplace=True))
    assert engine.llm.fake_probe("admissions")["reused"][1:] == [4, True]
    assert engine.llm.fake_probe("lora_loads")[0] - loads >= 4


def test_adapters_the_engine_would_not_apply_are_refused_and_the_previous_serves_on(
    engine: VLLMEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused names (vLLM expects the unfused ones and refuses ``qkv_proj``), modules the model lacks (vLLM accepts
    them and serves the base model: #55193) and a count of applied modules other than the count sent are
    refused with ValueError; the adapter loaded before keeps serving."""
    good = adapter_tensors(model_dir, seed=1)
    engine.load_adapter("policy-v1", SPEC, good)
    fused = {n.replace(".q_proj.", ".qkv_proj."): t for n, t in good.items()}
    with pytest.raises(ValueError, match=r"qkv_proj: a fused name; send the unfused ones \(q_proj, k_proj, v_proj\)"):
        engine.load_adapter("policy-v2", SPEC, fused)
    outside = {n.replace("model.layers.", "layers."): t for n, t in good.items()}
    with pytest.raises(ValueError, match=r"no such module in the model"):
        engine.load_adapter("policy-v2", SPEC, outside)
    sent = len(good) // 2
    monkeypatch.setattr(adapter, "adapter_module_count", lambda tensors, specs, engine: sent)  # vLLM decides alone
    with pytest.raises(ValueError, match=rf"adapter policy-v2: vLLM adapted 0 modules, {sent} were sent"):
        engine.load_adapter("policy-v2", SPEC, outside)
    assert engine.llm.llm_engine.list_loras() == {1}
    assert_served(engine, adapted_model(model_dir, good))


def test_check_engine_lora_sets_what_each_engine_needs_and_refuses_conflicts() -> None:
    """``relayrl check-engine --lora``: LoRA on, the rank, room for two adapters (serving + previous); the fakes
    take every key as vLLM's EngineArgs and SGLang's ServerArgs do."""
    from fakes import fake_sglang

    from relayrl.check_engine import lora_engine_options

    vllm_options = lora_engine_options("vllm", {"enforce_eager": True}, rank=8)
    assert vllm_options == {"enforce_eager": True, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    assert set(vllm_options) <= fake_vllm.ENGINE_ARGS
    sglang_options = lora_engine_options("sglang", {}, rank=8)
    assert set(sglang_options) <= fake_sglang.SERVER_ARGS and sglang_options["max_loras_per_batch"] == 2
    assert lora_engine_options("hf", {"device": "cpu"}, rank=8) == {"device": "cpu"}
    with pytest.raises(ValueError, match=r"^--option enable_lora: the vllm engine serves adapters only with"):
        lora_engine_options("vllm", {"enable_lora": False}, rank=8)
    with pytest.raises(ValueError, match=r"^--option max_lora_rank: must be at least 16 for relayrl's adapters"):
        lora_engine_options("sglang", {"max_lora_rank": 8}, rank=16)


def test_an_adapter_update_through_the_rollout_worker(engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    """A LoRA run's adapter manifest (``kind="adapter"``) handed to the engine by the rollout worker: the vLLM
    workers read its tensors, worker 0 writes the PEFT directory, and it is added as ``policy-v1``."""
    tensors = adapter_tensors(model_dir, seed=5)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    layout = build_manifest(specs, version=1, bucket_bytes=4096)
    manifest = layout.with_header(version=1, transport="filesystem", kind="adapter", lora=SPEC)
    write_weights(tmp_path, manifest, tensors)
    manifest = manifest.with_header(
        version=1, transport="filesystem", path=str(tmp_path.resolve()), kind="adapter", lora=SPEC
    )
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    response = worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    assert response.policy_version == 1 and engine._adapters[-1].lora_name == "policy-v1"
    assert_served(engine, adapted_model(model_dir, tensors))


@pytest.mark.parametrize("failure", ["raises", "returns False"])
def test_a_version_vllm_fails_to_remove_is_a_warning_naming_it(
    engine: VLLMEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    """Rotating out version 1 when ``remove_lora`` fails (an error, or False: vLLM did not hold it) is logged at
    WARNING naming the version: it keeps one of the engine's LoRA slots, which must not go unseen. The new
    version serves on, and the old version's files are still deleted."""
    engine.load_adapter("policy-v1", SPEC, adapter_tensors(model_dir, seed=1))
    engine.load_adapter("policy-v2", SPEC, adapter_tensors(model_dir, seed=2))
    first = engine._adapters[0]

    def remove_lora(lora_id: int) -> bool:
        if failure == "raises":
            raise RuntimeError("engine core is busy")
        return False

    monkeypatch.setattr(engine.llm.llm_engine, "remove_lora", remove_lora)
    with caplog.at_level("WARNING", logger="relayrl.rollout.vllm"):
        engine.load_adapter("policy-v3", SPEC, adapter_tensors(model_dir, seed=3))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("remove_lora(1) of policy-v1 failed" in m for m in warned), warned
    assert engine._adapters[-1].lora_name == "policy-v3" and not os.path.exists(first.lora_path)
