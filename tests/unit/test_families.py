"""The model-family matrix: every family's tiny model (relayrl/models/families.py) builds from its own config
class, seeded, and loads back through ``AutoModelForCausalLM`` as a user's model directory does; and on every
family each trainer fast path does what ``families.claim`` declares: an ``exact`` path is taken and gives the plain
model forward's logprobs, entropies and gradients (float32 within 1e-5; bf16 compute within ``BF16_BOUND``), a
``falls back`` path logs why and gives the plain forward's, on one rank and (a few families) on two."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from trainer_testing import grpo_batch, on_ranks_case, spawn_ranks
from transformers import AutoModelForCausalLM

from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from relayrl.config import LoraConfig, ModelConfig, TrainerConfig
from relayrl.models.families import (
    FAMILIES,
    PATHS,
    STATUSES,
    TRAINER_PATHS,
    build_family_model,
    claim,
    write_family_model,
)
from relayrl.runtime.ports import free_port
from relayrl.trainer import head
from relayrl.trainer.backends.fsdp import FSDPBackend

TOLERANCE = 1e-5
# bf16 compute (float32 attention on a CPU) against the float32 forward: logprob/entropy gaps in nats, gradient gaps
# relative to the largest gradient entry
BF16_BOUND = {"logprobs": 0.05, "entropy": 0.05, "grads": 0.05}
TEMPERATURE = 0.8
# the trainer config each path is measured under (one path on at a time; bf16 and LoRA with shared prompts on, as
# trainer.shared_prefix auto takes them on a GRPO batch)
PATH_CONFIG = {
    "shared_prefix": {"shared_prefix": "on", "padding_free": "off"},
    "chunked_head": {"shared_prefix": "off", "padding_free": "off"},
    "padding_free": {"shared_prefix": "off", "padding_free": "on"},
    "bf16": {"shared_prefix": "on", "padding_free": "off", "precision": "bfloat16"},
    "lora": {"shared_prefix": "on", "padding_free": "off"},
}
# the families the two-rank check runs: a sliding window under SDPA, eager attention with a window and soft-capping,
# a scaled head
TWO_RANK_FAMILIES = ("mistral", "gemma2", "granite")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_builds_from_its_own_config_seeded_and_loads_back(family, tmp_path) -> None:
    spec = FAMILIES[family]
    model = build_family_model(family, seed=3)
    assert type(model.config) is getattr(transformers, spec.config_class)
    assert type(model) is getattr(transformers, spec.model_class)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    again = build_family_model(family, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    loaded = AutoModelForCausalLM.from_pretrained(write_family_model(family, tmp_path, seed=3))
    ids = torch.randint(3, 20, (2, 16))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_every_claim_is_one_of_the_statuses_and_a_claim_not_exact_says_why() -> None:
    for family in FAMILIES:
        for path in PATHS:
            found = claim(family, path)
            assert found.status in STATUSES and (found.status == "exact") == (found.reason == ""), (family, path)


def backend_for(model_dir: str, path: str) -> FSDPBackend:
    """The trainer's backend with ``path`` on (``PATH_CONFIG``); LoRA with a random, non-zero adapter."""
    cfg = TrainerConfig(**{"precision": "float32", "pack_token_budget": 256} | PATH_CONFIG[path])
    lora = LoraConfig() if path == "lora" else None
    torch.manual_seed(0)
    backend = FSDPBackend(ModelConfig(path=model_dir, lora=lora), cfg, with_reference=False)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    return backend


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def gaps(backend: FSDPBackend, rows: slice = slice(None)) -> dict:
    """The backend's logprobs, entropies and gradients (of a loss weighing both at random) on ``rows`` of a GRPO
    batch, against the plain model forward's (float32, every row padded to the longest, no mask): the largest gaps,
    the gradients' relative to their largest entry (on two ranks: this rank's shards of the reduced gradients)."""
    batch = grpo_batch()
    ids, attention, scored, groups = (
        t[rows] for t in (batch.input_ids, batch.attention_mask, batch.response_mask.bool(), batch.group_ids)
    )
    weights = torch.randn((2, *scored.shape), generator=torch.Generator().manual_seed(1))

    def grads_of(logprob: torch.Tensor, entropy: torch.Tensor) -> list[torch.Tensor]:
        loss = ((logprob * weights[0] + entropy * weights[1]) * scored).sum() / scored.sum()
        loss.backward()
        out = [local(p.grad).clone() for p in backend.trainable]
        backend.optimizer.zero_grad(set_to_none=True)
        return out

    logits = backend.model(input_ids=ids, use_cache=False).logits[:, :-1]
    plain = logprobs_from_logits(logits, ids[:, 1:], TEMPERATURE), entropy_from_logits(logits, TEMPERATURE)
    plain_grads = grads_of(*plain)
    fast = backend.logprobs(ids, attention, TEMPERATURE, scored=scored, groups=groups)
    fast_grads = grads_of(*fast)
    plain, fast = [tuple(t.detach() for t in pair) for pair in (plain, fast)]
    largest = max(float(g.abs().max()) for g in plain_grads)
    return {
        "logprobs": float(((fast[0] - plain[0]) * scored).abs().max()),
        "entropy": float(((fast[1] - plain[1]) * scored).abs().max()),
        "grads": max(float((a - b).abs().max()) for a, b in zip(fast_grads, plain_grads, strict=True)) / largest,
        "largest_grad": largest,
    }


def taken(path: str, backend: FSDPBackend, log: str, head_calls: int) -> bool:
    """Whether the backend's last logprobs took ``path``."""
    return {
        "shared_prefix": "trainer.shared_prefix=on: shared" in log,
        "chunked_head": head_calls > 0,
        "padding_free": "trainer.padding_free=on: packed rows" in log,
        "bf16": backend.precision.compute == torch.bfloat16,
        "lora": hasattr(backend.model, "get_base_model"),
    }[path]


@pytest.fixture
def one_rank():
    """A gloo world of one rank (the backend's collectives)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_trainer_path_does_what_the_family_claims(family, tmp_path, caplog, monkeypatch) -> None:
    model_dir = str(write_family_model(family, tmp_path))
    calls = []
    apply = head.HeadLogprobs.apply
    monkeypatch.setattr(head.HeadLogprobs, "apply", lambda *args: calls.append(1) or apply(*args))
    caplog.set_level(logging.INFO, logger="relayrl")
    failures = {}
    for path in TRAINER_PATHS:
        declared = claim(family, path)
        caplog.clear()
        calls.clear()
        backend = backend_for(model_dir, path)
        result = gaps(backend)
        bound = BF16_BOUND if path == "bf16" else dict.fromkeys(("logprobs", "entropy", "grads"), TOLERANCE)
        if any(result[key] > bound[key] for key in bound):
            failures[path] = result
        if declared.status == "exact" and not taken(path, backend, caplog.text, len(calls)):
            failures[path] = "not taken"
        if declared.status == "falls back" and declared.reason not in caplog.text:
            failures[path] = f"no log line says {declared.reason!r}"
    assert not failures, failures


def two_rank_gaps(model_dirs: dict[str, str]) -> dict:
    """On each rank its half of the batch's rows: shared prompts and padding-free packing, per family."""
    rank = dist.get_rank()
    rows = slice(0, 7) if rank == 0 else slice(7, None)  # rank 0: groups 0 and 1 (less 1 row), rank 1: the rest
    return {
        f"{family}/{path}": gaps(backend_for(model_dir, path), rows)
        for family, model_dir in model_dirs.items()
        for path in ("shared_prefix", "padding_free")
    }


def test_two_ranks_match_the_plain_forward_on_shared_prompts_and_packing(tmp_path) -> None:
    dirs = {family: str(write_family_model(family, tmp_path / family)) for family in TWO_RANK_FAMILIES}
    out = tmp_path / "result.json"
    spawn_ranks(on_ranks_case, (2, free_port(), two_rank_gaps, (dirs,), str(out)), 2)
    result = json.loads(out.read_text())
    assert all(max(r["logprobs"], r["entropy"], r["grads"]) < TOLERANCE for r in result.values()), result


def test_a_head_adapted_by_lora_takes_the_models_own_logits_and_says_why(caplog) -> None:
    import peft

    model = build_family_model("llama3")
    assert head.head_plan(model).scale == 1.0  # probed: the plain matmul
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"]))
    caplog.set_level(logging.INFO, logger="relayrl")
    assert head.head_plan(adapted).scale is None
    assert "chunked output head off for LlamaForCausalLM: its output head is a peft." in caplog.text
    assert "not a torch Linear; its own logits are used" in caplog.text


def test_a_model_the_layout_cannot_reproduce_never_shares_and_says_why(caplog) -> None:
    """Gemma3 with bidirectional attention (EmbeddingGemma's): its rows see later tokens, the layout's causal mask
    does not; the probe at load finds it, and the first decision logs why."""
    from relayrl.trainer.prefix import SharedPrefix, layout_unsupported

    model = build_family_model("gemma3")
    assert layout_unsupported(model) is None
    model = build_family_model("gemma3")
    model.config.use_bidirectional_attention = True
    reason = layout_unsupported(model)
    assert reason.startswith("a probe's shared layout misses its padded rows' logits by"), reason
    caplog.set_level(logging.INFO, logger="relayrl")
    assert not SharedPrefix("on", 1024, available=False, reason=reason).decide(400, 100, 50)
    assert f"trainer.shared_prefix=on: not shared ({reason})" in caplog.text
