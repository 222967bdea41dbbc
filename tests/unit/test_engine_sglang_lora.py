"""LoRA on the sglang adapter, through the fake ``sglang`` (tests/fakes/fake_sglang.py): adapters loaded from tensors
(``load_lora_adapter_from_tensors``), a name already loaded refused, requests naming the adapter in ``lora_path``,
the radix cache keyed by each load's id."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from engine_testing import PROMPTS, sharp_tiny_model
from fakes import fake_sglang
from test_engine_vllm_lora import PARAMS, SPEC, adapted_model, adapter_tensors, assert_served

from relayrl.rollout.sglang import SGLangEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.v1 import rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.manifest import build_manifest
from relayrl.wire.sampling import GenerationLimits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    for name in fake_sglang.MODULES:
        monkeypatch.setitem(sys.modules, name, fake_sglang)
    eng = SGLangEngine(
        str(model_dir), dtype="float32", max_batch_size=8, seed=0, enable_deterministic_inference=True, enable_lora=True
    )
    yield eng
    eng.close()


def test_the_adapter_is_served_with_the_trainers_logprobs(engine: SGLangEngine, model_dir: Path) -> None:
    tensors = adapter_tensors(model_dir, seed=1)
    sent = copy.deepcopy(tensors)
    assert engine.load_adapter("policy-v1", SPEC, tensors) == len(tensors) // 2
    assert_served(engine, adapted_model(model_dir, sent))
    assert engine.engine.generate_calls[-1]["lora_path"] == ["policy-v1"] * len(PROMPTS) * PARAMS.n
    assert engine.load_adapter("policy-v2", SPEC, tensors) == len(tensors) // 2  # the same tensors, scaled once
    assert_served(engine, adapted_model(model_dir, sent))
    assert all(torch.equal(tensors[n], sent[n]) for n in sent)


def test_every_version_has_its_own_name(engine: SGLangEngine, model_dir: Path) -> None:
    """SGLang refuses to load a name it has loaded; each version is a new name (its radix entries keyed by a
    new load id, so version 2 reuses nothing of version 1's KV); versions before the previous are unloaded."""
    engine.load_adapter("policy-v1", SPEC, adapter_tensors(model_dir, seed=1))
    again = engine.engine.load_lora_adapter_from_tensors("policy-v1", adapter_tensors(model_dir, seed=2), {"r": 4})
    assert not again.success and "already loaded" in again.error_message
    list(engine.generate(PROMPTS[1:2], PARAMS))
    engine.load_adapter("policy-v2", SPEC, adapter_tensors(model_dir, seed=2))
    list(engine.generate(PROMPTS[1:2], PARAMS))
    first_of_call = engine.engine.generate_calls[-1]["rid"][0]
    assert engine.engine.admissions[first_of_call][1:] == (0, False)
    engine.load_adapter("policy-v3", SPEC, adapter_tensors(model_dir, seed=3))
    assert set(engine.engine.loras) == {"policy-v2", "policy-v3"}


def test_adapters_the_engine_would_not_apply_are_refused(engine: SGLangEngine, model_dir: Path) -> None:
    good = adapter_tensors(model_dir, seed=1)
    engine.load_adapter("policy-v1", SPEC, good)
    fused = {n.replace(".q_proj.", ".qkv_proj."): t for n, t in good.items()}
    with pytest.raises(ValueError, match=r"qkv_proj: a fused name"):
        engine.load_adapter("policy-v2", SPEC, fused)
    outside = {n.replace("model.layers.", "layers."): t for n, t in good.items()}
    with pytest.raises(ValueError, match=r"no such module in the model"):
        engine.load_adapter("policy-v2", SPEC, outside)
    assert set(engine.engine.loras) == {"policy-v1"}
    assert_served(engine, adapted_model(model_dir, good))


def test_an_adapter_update_through_the_rollout_worker(engine: SGLangEngine, model_dir: Path, tmp_path: Path) -> None:
    """A LoRA run's adapter manifest (``kind="adapter"``) handed to the engine by the rollout worker: the
    schedulers receive its tensors through relayrl's loader without touching the model, scheduler 0 keeps them
    aside, and they are loaded as ``policy-v1``."""
    tensors = adapter_tensors(model_dir, seed=5)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    layout = build_manifest(specs, version=1, bucket_bytes=4096)
    manifest = layout.with_header(version=1, transport="filesystem", kind="adapter", lora=SPEC)
    write_weights(tmp_path, manifest, tensors)
    path = str(tmp_path.resolve())
    manifest = manifest.with_header(version=1, transport="filesystem", path=path, kind="adapter", lora=SPEC)
    worker = RolloutWorker(engine, "w0", mode="pause", limits=GenerationLimits())
    response = worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    assert response.policy_version == 1 and set(engine.engine.loras) == {"policy-v1"}
    assert_served(engine, adapted_model(model_dir, tensors))
