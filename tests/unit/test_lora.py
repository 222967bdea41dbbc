"""LoRA (model.lora): the config and its refusals, adapter manifests on the wire, the trainer's PEFT policy against
the hf engine's unmerged adapter (logprobs within 1e-5 on both decode runners), the export (a PEFT adapter
directory and the merged model), the bytes an adapter sync saves, and a worker that keeps its previous adapter
and version when a new one fails to load."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import peft
import pytest
import torch
from engine_testing import PROMPTS, sharp_tiny_model
from trainer_testing import one_rank_world  # noqa: F401 (an autouse fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.check_engine import _served_worker
from relayrl.config import ConfigError, LoraConfig, ModelConfig, TrainerConfig, parse_config
from relayrl.models.tiny import write_tiny_model
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.v1 import common_pb2, rollout_pb2
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.manifest import LayoutCache, WeightManifest, build_manifest
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import GenerationLimits, SamplingParams

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
SPEC = LoraAdapterSpec(8, 16.0, ("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_model(tmp_path_factory.mktemp("tiny"))


def lora_backend(model_dir: Path, **lora) -> FSDPBackend:
    """The trainer's policy with a random adapter (PEFT starts B at zero: the base model itself)."""
    backend = FSDPBackend(
        ModelConfig(path=str(model_dir), lora=LoraConfig(**lora)),
        TrainerConfig(lr=0.01, precision="float32"),
        with_reference=False,
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return backend


def adapter_of(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    into = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in backend.weight_specs("adapter")}
    backend.gather_weights(into, "adapter")
    return into


def trainer_logprobs(backend, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return backend.logprobs(ids, torch.ones_like(ids), 1.0)[0][0, len(prompt) - 1 :]


def max_gap(backend, completions) -> float:
    return max(
        float((torch.tensor(c.logprobs) - trainer_logprobs(backend, PROMPTS[c.prompt_index], c.token_ids)).abs().max())
        for c in completions
    )


def base_config(**model) -> dict:
    return {"model": {"path": "m", **model}, "data": {"path": "d"}}


def test_model_lora_defaults_and_refusals() -> None:
    cfg = parse_config(base_config(lora={"rank": 4}))
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (4, 16.0, ALL_LINEAR[:4])
    with pytest.raises(ConfigError, match=r"model\.lora: LoRA trains on trainer\.backend fsdp only, not megatron"):
        parse_config({**base_config(lora={}), "trainer": {"backend": "megatron"}})
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: .*at least one module"):
        parse_config(base_config(lora={"target_modules": []}))
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        parse_config(base_config(lora={"rank": 0}))


def test_an_adapter_manifest_carries_its_kind_and_spec_on_the_wire() -> None:
    layout = build_manifest([("base_model.model.x.lora_A.weight", (8, 4), torch.float32)], version=0)
    adapter = layout.with_header(version=3, kind="adapter", lora=SPEC)
    assert WeightManifest.from_proto(adapter.to_proto()) == adapter
    cache = LayoutCache()
    cache.resolve(adapter.to_proto())
    compact = cache.resolve(layout.with_header(version=4, kind="adapter", lora=SPEC).to_proto(compact=True))
    assert (compact.version, compact.kind, compact.lora) == (4, "adapter", SPEC)
    assert WeightManifest.from_proto(layout.to_proto()).kind == "full"  # proto3 "" is a full update
    with pytest.raises(ValueError, match="lora: an adapter manifest needs its LoraSpec"):
        layout.with_header(version=1, kind="adapter")
    with pytest.raises(ValueError, match="kind: 'delta' is not one of"):
        layout.with_header(version=1, kind="delta")


@pytest.mark.parametrize("decode", ["fast", "transformers"])
def test_trainer_and_hf_engine_logprobs_agree_with_the_adapter(model_dir, decode) -> None:
    backend = lora_backend(model_dir, target_modules=ALL_LINEAR)
    engine = HFEngine(str(model_dir), decode=decode, attn_implementation="eager" if decode != "fast" else "sdpa")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5)
    base = list(engine.generate(PROMPTS, params))
    assert engine.load_adapter("policy-v1.1", backend.lora, adapter_of(backend)) == 2 * 7 + 1
    adapted = list(engine.generate(PROMPTS, params))
    assert max_gap(backend, adapted) <= 1e-5
    assert max_gap(backend, base) > 1e-2  # the adapter matters: the base model's logprobs are not the trainer's


def test_the_exported_adapter_loads_with_peft_and_gives_the_trainers_logprobs(model_dir, tmp_path) -> None:
    backend = lora_backend(model_dir, export_merged=True)
    backend.export_hf(tmp_path / "final", AutoTokenizer.from_pretrained(model_dir))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "final/adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final/merged")
    prompt, response = PROMPTS[1], [3, 5, 7, 9]
    ids = torch.tensor([prompt + response])
    expected = trainer_logprobs(backend, prompt, response)
    for model, tolerance in ((loaded, 1e-6), (merged, 1e-4)):  # merging W + s B A rounds differently
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        got = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)


def test_the_gen_heavy_models_adapter_is_at_most_5_percent_of_its_weights(tmp_path) -> None:
    """hidden 256, 4 layers (relayrl/bench/e2e.py's gen-heavy workload), the default rank-8 adapter."""
    path = write_tiny_model(tmp_path / "gen-heavy", hidden_size=256, layers=4)
    backend = FSDPBackend(ModelConfig(path=str(path), lora=LoraConfig()), TrainerConfig(), with_reference=False)
    nbytes = {
        kind: sum(dtype.itemsize * torch.Size(shape).numel() for _, shape, dtype in backend.weight_specs(kind))
        for kind in ("base", "adapter")
    }
    assert nbytes["adapter"] / nbytes["base"] <= 0.05, nbytes


def test_a_failed_adapter_load_leaves_the_previous_version_serving(model_dir) -> None:
    backend = lora_backend(model_dir)
    engine = HFEngine(str(model_dir))
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    with _served_worker(engine, "cpu", lora=backend.lora) as (worker, publisher):
        backend.gather_weights(dict(publisher.arena_for(backend.weight_specs("base"), "base").views()), "base")
        good = adapter_of(backend)
        results = []
        for version, tensors in [(1, good), (2, good)]:
            arena = publisher.arena_for([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], "adapter")
            arena.load(tensors.items())
            results.append(publisher.publish(version, arena, kind="adapter"))
        adapter_bytes = arena.manifest.total_bytes
        assert [r.synced for r in results] == [[worker.worker_id]] * 2
        assert results[0].nbytes > adapter_bytes == results[1].nbytes  # the base went once
        serving = list(engine.generate(PROMPTS, greedy))
        assert max_gap(backend, serving) <= 1e-5
        one_b_missing = {n: t for n, t in good.items() if not n.endswith("layers.1.self_attn.v_proj.lora_B.weight")}
        no_such_module = {
            **good,
            "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": good[next(iter(good))],
        }
        for version, tensors in [(3, one_b_missing), (4, no_such_module)]:
            arena = publisher.arena_for([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], "adapter")
            arena.load(tensors.items())
            result = publisher.publish(version, arena, kind="adapter")
            assert result.synced == [] and (worker.reported_version, worker.state) == (2, "serving")
            after = list(engine.generate(PROMPTS, greedy))
            assert [c.logprobs for c in after] == [c.logprobs for c in serving]


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes_them(model_dir, tmp_path) -> None:
    backend = lora_backend(model_dir)
    for p in backend.trainable:  # one optimizer step, so that the AdamW moments exist
        p.grad = torch.ones_like(p)
    backend.step(1.0)
    backend.save_checkpoint(tmp_path / "step_1", {"step": 1})
    resumed = FSDPBackend(
        ModelConfig(path=str(model_dir), lora=LoraConfig()),
        TrainerConfig(lr=0.01, precision="float32"),
        with_reference=False,
    )
    assert resumed.load_checkpoint(tmp_path / "step_1") == {"step": 1}
    for name, tensor in adapter_of(backend).items():
        torch.testing.assert_close(adapter_of(resumed)[name], tensor, atol=0, rtol=0, msg=name)
    moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert len(moments) == len(backend.trainable) and all(bool(m.abs().sum() > 0) for m in moments)


def test_an_adapter_update_in_flight_continues_the_rows_on_the_new_adapter(model_dir, tmp_path) -> None:
    """rollout.partial: a long request is frozen at a step boundary, the adapter of version 7 is loaded under it
    (through UpdateWeights, filesystem transport), and its rows go on: none aborted, every token stamped with the
    version that sampled it, the later tokens' logprobs the trainer's for the new adapter."""
    backend = lora_backend(model_dir)
    tensors = adapter_of(backend)
    layout = build_manifest([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], version=7)
    manifest = layout.with_header(
        version=7, transport="filesystem", path=str(tmp_path), kind="adapter", lora=backend.lora
    )
    write_weights(tmp_path, manifest, tensors)
    engine = HFEngine(str(model_dir), partial="recompute")
    worker = RolloutWorker(engine, "w", mode="pause", limits=GenerationLimits(), partial="recompute")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id="p", token_ids=PROMPTS[1])], params=params.to_proto()
    )
    steps, release, out = 0, threading.Event(), []

    def is_active() -> bool:  # the scheduler asks once a step: held at step 4 until the update asks for the pause
        nonlocal steps
        steps += 1
        if steps == 4:
            release.wait()
        return True

    generating = threading.Thread(target=lambda: out.extend(worker.generate(request, is_active)))
    generating.start()
    updating = threading.Thread(
        target=lambda: worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto()))
    )
    updating.start()
    deadline = time.monotonic() + 60
    while not engine._batcher._pausing and time.monotonic() < deadline:  # (a worker that aborts never pauses)
        time.sleep(0.001)
    release.set()
    updating.join()
    generating.join()
    engine.close()
    completions = [c for response in out for c in response.completions]
    assert worker.version == 7 and len(completions) == 2
    for c in completions:
        assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH and set(c.token_versions) == {0, 7}, c
        new = [i for i, v in enumerate(c.token_versions) if v == 7]
        expected = trainer_logprobs(backend, PROMPTS[1], list(c.token_ids))[new]
        torch.testing.assert_close(torch.tensor(c.logprobs)[new], expected, atol=1e-5, rtol=0)
