"""Routing replay (relayrl/algorithms/routing_replay.py) on the tiny MoE families: a forward replaying the indices
the model's own routers chose is the model's own forward exactly; other indices change the output while the router
keeps its gradient; the wire form round-trips and refuses a size that is not whole tokens."""

from __future__ import annotations

import sys

import pytest
import torch
from fakes import fake_sglang, fake_vllm
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.algorithms.routing_replay import (
    RoutingRecorder,
    from_message,
    replaying,
    to_message,
    unsupported_reason,
)
from relayrl.errors import ResourceExhausted
from relayrl.models.families import build_family_model, write_family_model, write_near_tied_moe
from relayrl.rollout import sglang as sglang_adapter
from relayrl.rollout.engine import create_engine
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.trainer.batch import to_train_batch
from relayrl.v1 import common_pb2, controller_pb2, rollout_pb2
from relayrl.wire.sampling import GenerationLimits, SamplingParams

IDS = torch.tensor([[3, 5, 7, 9, 11, 4, 6, 8], [12, 13, 14, 15, 16, 17, 18, 19]])


@pytest.mark.parametrize("family", ["qwen2-moe", "qwen3-moe"])
def test_a_forward_replaying_its_own_routing_is_the_models_forward_exactly(family) -> None:
    model = build_family_model(family, seed=1)
    recorder = RoutingRecorder(model)
    with torch.no_grad():
        own = model(input_ids=IDS).logits
    routing = recorder.take(rows=len(IDS))
    recorder.close()
    assert routing.shape == (2, 8, 2, 2)
    with torch.no_grad(), replaying(model, routing.reshape(-1, 2, 2)):
        replayed = model(input_ids=IDS).logits
    assert torch.equal(replayed, own)


def test_other_experts_change_the_output_and_the_router_keeps_its_gradient() -> None:
    model = build_family_model("qwen2-moe", seed=1)
    recorder = RoutingRecorder(model)
    with torch.no_grad():
        own = model(input_ids=IDS).logits
    routing = recorder.take(rows=len(IDS)).reshape(-1, 2, 2).long()
    recorder.close()
    flipped = (routing + 1) % 4  # every token's experts moved to the next ones: never the router's own choice
    with replaying(model, flipped):
        replayed = model(input_ids=IDS).logits
    assert not torch.allclose(replayed, own)
    replayed.square().sum().backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_a_token_count_other_than_the_forwards_names_the_field() -> None:
    model = build_family_model("qwen2-moe", seed=1)
    with (
        pytest.raises(ValueError, match="routed_experts: 3 tokens for a forward of 16"),
        replaying(model, torch.zeros(3, 2, 2, dtype=torch.long)),
    ):
        model(input_ids=IDS)


def test_the_wire_bytes_round_trip_and_a_partial_token_is_refused() -> None:
    routing = torch.randint(0, 200, (5, 3, 2), dtype=torch.uint8)
    assert torch.equal(from_message(to_message(routing)), routing.long())
    wide = torch.randint(0, 300, (5, 3, 2), dtype=torch.int16)
    assert torch.equal(from_message(to_message(wide)), wide.long())
    assert to_message(wide).index_bytes == 2 and len(to_message(routing).indices) == 30
    with pytest.raises(ValueError, match="routed_experts: 7 bytes"):
        from_message(common_pb2.RoutedExperts(indices=b"\x00" * 7, layers=3, top_k=2, index_bytes=1))


def test_a_dense_model_has_nothing_to_replay() -> None:
    assert "dense model" in unsupported_reason(build_family_model("qwen2"))
    assert unsupported_reason(build_family_model("qwen2-moe")) is None


def test_the_engine_reports_its_routing_and_a_float32_forward_replaying_it_gives_the_engines_logprobs(
    tmp_path,
) -> None:
    """Setup (``families.write_near_tied_moe``): the routers' rows differ far below a bf16 ulp, so the hf engine in
    bf16 rounds a token's router logits into ties and takes other experts than a float32 forward does for most
    tokens, and the experts are scaled up so that this moves the logprobs. A float32 forward of each completion then
    misses the engine's logprobs by far more than bf16 rounding; replaying the engine's routed experts brings it
    back to bf16 rounding."""
    path = write_near_tied_moe(tmp_path / "moe")
    engine = HFEngine(str(path), dtype="bfloat16", routing_replay=True)
    prompts = [[3, 5, 7, 4], [12, 13, 14]]
    completions = list(engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1)))
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(path)
    own, replayed = [], []
    for c in completions:
        prompt = prompts[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        assert c.routed_experts.dtype == torch.uint8 and c.routed_experts.shape == (ids.shape[1] - 1, 2, 2)
        routing = torch.cat([c.routed_experts.long(), torch.zeros(1, 2, 2, dtype=torch.long)])  # the last: unread
        scored = slice(len(prompt) - 1, -1)
        with torch.no_grad():
            own.append(logprobs_from_logits(model(input_ids=ids).logits[0, scored], ids[0, len(prompt) :], 1.0))
            with replaying(model, routing):
                logits = model(input_ids=ids).logits[0, scored]
            replayed.append(logprobs_from_logits(logits, ids[0, len(prompt) :], 1.0))
    engine_logprobs = torch.cat([torch.tensor(c.logprobs) for c in completions])
    own_gap, replayed_gap = (torch.cat(own) - engine_logprobs).abs(), (torch.cat(replayed) - engine_logprobs).abs()
    assert replayed_gap.max() < 0.01, replayed_gap.max()  # measured ~0.0015: bf16 rounding
    assert own_gap.max() > 0.05 and own_gap.mean() > 5 * replayed_gap.mean(), (own_gap, replayed_gap)


def test_a_dense_model_is_refused_by_the_engine_naming_the_key(tmp_path) -> None:
    path = write_family_model("qwen2", tmp_path / "dense")
    with pytest.raises(ValueError, match=r"routing_replay \(algorithm.routing_replay\): model_type 'qwen2' has no"):
        HFEngine(str(path), routing_replay=True)


def test_a_group_whose_routing_would_not_fit_a_message_is_resource_exhausted(tmp_path) -> None:
    engine = HFEngine(str(write_near_tied_moe(tmp_path / "moe")), routing_replay=True)
    worker = RolloutWorker(engine, "w", mode="pause", limits=GenerationLimits(max_message_bytes=4 * 2 * 2 * 20))
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id="p", token_ids=[3, 4, 5])],
        params=common_pb2.SamplingParams(n=4, max_tokens=19),  # 4 x (3 + 19 - 1) tokens x 2 layers x 2 experts
    )
    with pytest.raises(ResourceExhausted, match="routed_experts: 336 exceeds the limit 320"):
        next(iter(worker.generate(request, lambda: True)))
    engine.close()


def test_the_train_batch_lays_each_samples_routing_on_its_row_and_names_a_wrong_one() -> None:
    def sample(prompt_id: str, prompt: list[int], response: list[int], tokens: int) -> controller_pb2.Sample:
        routing = torch.arange(tokens * 4, dtype=torch.uint8).reshape(tokens, 2, 2)
        return controller_pb2.Sample(
            prompt_id=prompt_id, prompt_token_ids=prompt, response_token_ids=response,
            rollout_logprobs=[0.0] * len(response), routed_experts=to_message(routing),
        )  # fmt: skip

    short, long = sample("a", [3, 4], [5], 2), sample("b", [3, 4, 6], [5, 7, 8], 5)
    batch = to_train_batch([short, long], pad_token_id=0)
    assert batch.routed_experts.shape == (2, 6, 2, 2)
    assert torch.equal(batch.routed_experts[1, :5], from_message(long.routed_experts))
    assert batch.routed_experts[0, 2:].eq(0).all() and batch.select(torch.tensor([1])).routed_experts.shape[0] == 1
    with pytest.raises(ValueError, match=r"samples\[b\].routed_experts: shape \(5, 2, 2\), expected \(4, 2, 2\)"):
        to_train_batch([sample("b", [3, 4], [5, 7, 8], 5)], pad_token_id=0)
    bare = controller_pb2.Sample(prompt_id="c", prompt_token_ids=[3], response_token_ids=[5], rollout_logprobs=[0.0])
    with pytest.raises(ValueError, match=r"samples\[c\].routed_experts: missing where other samples"):
        to_train_batch([short, bare], pad_token_id=0)
    assert to_train_batch([bare], pad_token_id=0).routed_experts is None


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_vllm_and_sglang_adapters_map_their_engines_routed_experts(name, monkeypatch, tmp_path) -> None:
    """Against the fakes (tests/fakes/common.py ``RoutedExpertsCapture``: vLLM's ``CompletionOutput.routed_experts``
    uint8 array, SGLang's base64 int32 ``meta_info["routed_experts"]``, each every token but the last): each
    completion's routed experts are the model's own routing of its prompt and its tokens but the last."""
    fake = {"vllm": fake_vllm, "sglang": fake_sglang}[name]
    for module in fake.MODULES:
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(sglang_adapter, "_RECEIVERS", {})
    path = write_family_model("qwen2-moe", tmp_path / "moe")
    with pytest.raises(ValueError, match=rf"algorithm.routing_replay\): {name} engine: model_type 'qwen2' has no"):
        create_engine(name, model_path=str(write_family_model("qwen2", tmp_path / "dense")), routing_replay=True)
    engine = create_engine(name, model_path=str(path), dtype="float32", seed=0, routing_replay=True)
    prompts = [[3, 5, 7, 4], [12, 13, 14]]
    try:
        completions = list(engine.generate(prompts, SamplingParams(n=2, max_tokens=5, seed=1)))
    finally:
        engine.close()
    assert engine.routed_bytes_per_token == 2 * 2 * 1  # layers x k x one byte (4 experts)
    model = AutoModelForCausalLM.from_pretrained(path)
    recorder = RoutingRecorder(model)
    for c in completions:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompts[c.prompt_index] + c.token_ids[:-1]]))
        assert c.routed_experts.dtype == torch.uint8 and torch.equal(c.routed_experts, recorder.take(1)[0])
