"""The fast Llama-family decode runner (relayrl/rollout/llama_decode.py): exact logprobs against a plain forward
and the transformers runner (Qwen2; Llama with biases and YaRN RoPE; Mistral; Qwen3's per-head q/k norms), with rows
of concurrent calls batched (left padding, rows joining and leaving); its KV cache's select/merge/trim against the
transformers runner's; which runner ``rollout.hf_decode`` picks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_testing import sharp_tiny_model
from test_hf_engine import by_key, generate_in_threads, recompute_logprobs
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen3Config

from relayrl.models.tiny import build_tokenizer
from relayrl.rollout.hf import HFEngine, _pad_left
from relayrl.rollout.llama_decode import KVState, unsupported_reason
from relayrl.wire.sampling import SamplingParams

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [14]]
EXACT = 1e-5  # |fast logprob - trainer logprob|: float rounding only
# Llama, Mistral and Qwen3 variants with what Qwen2's tiny model lacks: biases on every projection, a head_dim that
# is not hidden / heads, no KV grouping, YaRN RoPE (its inv_freq and its attention_scaling of cos and sin), another
# rope_theta and RMSNorm eps, per-head q/k norms.
SMALL = {"vocab_size": 23, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4}
SMALL |= {"max_position_embeddings": 64, "eos_token_id": 1, "bos_token_id": 1, "pad_token_id": 0}
LLAMA = LlamaConfig(**SMALL, num_key_value_heads=4, head_dim=16, attention_bias=True, mlp_bias=True)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA_YARN = LlamaConfig(**SMALL, num_key_value_heads=2, rope_parameters=YARN)
QWEN3 = Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16)
# scaled per forward by the sequence length (transformers' dynamic_rope_update): the fast runner does not claim it
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
MISTRAL = MistralConfig(
    **SMALL | {"num_attention_heads": 6}, num_key_value_heads=2, sliding_window=None, rms_norm_eps=1e-5
)
MISTRAL.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}


def write_model(path: Path, config: PretrainedConfig) -> Path:
    """A randomly initialised model of ``config`` (matrices x4: sharp logits; norm weights and biases scaled by
    0.5-1.5 each: norms initialised to ones would hide one applied wrongly) and the tiny tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for weight in model.parameters():
            weight.mul_(4.0 if weight.ndim == 2 else torch.rand_like(weight) + 0.5)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral", "llama-yarn", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    configs = {"llama": LLAMA, "mistral": MISTRAL, "llama-yarn": LLAMA_YARN, "qwen3": QWEN3}
    return sharp_tiny_model(path) if request.param == "qwen2" else write_model(path, configs[request.param])


def test_fast_logprobs_equal_a_plain_forward_and_the_transformers_runner(model_dir) -> None:
    """Four seeded calls (different prompt lengths, temperatures, top-p, n, max_tokens; EOS ends rows early) join
    one running batch at different steps: every token and logprob of the fast runner equals the transformers
    runner's, and every logprob the plain forward's, within float rounding."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    calls = [
        ([PROMPTS[0], PROMPTS[2]], SamplingParams(n=3, temperature=1.0, max_tokens=14, seed=1)),
        ([PROMPTS[1]], SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=9, seed=2)),
        ([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3, 4]], SamplingParams(n=2, temperature=0, max_tokens=6)),
        ([PROMPTS[2], PROMPTS[1]], SamplingParams(n=2, temperature=1.3, max_tokens=30, seed=3)),
    ]
    delays = [0.0, 0.02, 0.05, 0.08]
    results = {}
    for decode in ("fast", "transformers"):
        engine = HFEngine(str(model_dir), decode=decode, max_batch_size=64)
        assert engine.decoder == decode
        results[decode] = [by_key(r) for r in generate_in_threads(engine, calls, delays)]
        if decode == "fast":
            assert engine._batcher.peak_requests >= 2, "rows of different calls were never decoded together"
        engine.close()
    worst = 0.0
    for (prompts, params), fast, slow in zip(calls, results["fast"], results["transformers"], strict=True):
        assert set(fast) == set(slow) == {(p, s) for p in range(len(prompts)) for s in range(params.n)}
        for key, c in fast.items():
            assert (c.token_ids, c.finish_reason) == (slow[key].token_ids, slow[key].finish_reason)
            expected = recompute_logprobs(reference, prompts[key[0]], c.token_ids, params.temperature or 1.0)
            worst = max(worst, float((torch.tensor(c.logprobs) - torch.tensor(expected)).abs().max()))
            worst = max(worst, float((torch.tensor(c.logprobs) - torch.tensor(slow[key].logprobs)).abs().max()))
    assert any(c.finish_reason == "stop" for r in results["fast"] for c in r.values()), "no row left early"
    assert worst < EXACT


def test_fast_prefill_equals_the_transformers_prefill(model_dir) -> None:
    """Prompts of 1 to 12 tokens prefilled together (left pads, whole query rows of pads with no key to attend to),
    rows repeated per sample: the same last-position logits and the same keys and values of every real token as the
    transformers forward's, within float rounding, and finite everywhere."""
    engine = HFEngine(str(model_dir), decode="fast")
    fast, slow = engine._batcher.runner, engine._batcher.runner.prefiller
    prompts = [PROMPTS[1], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 3, 4], PROMPTS[2], PROMPTS[0]]
    expand = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    with torch.no_grad():
        fast_logits, state = fast.prefill(prompts, expand)
        slow_logits, reference = slow.prefill(prompts, expand)
    engine.close()
    assert float((fast_logits - slow_logits).abs().max()) < EXACT
    live = slice(state.start, state.end)
    assert torch.equal(state.mask[: state.rows, live], reference.mask.bool())
    real = reference.mask.bool()[:, None, :, None]
    for i, layer in enumerate(reference.cache.layers):
        for mine, theirs in ((state.keys[i], layer.keys), (state.values[i], layer.values)):
            assert bool(torch.isfinite(mine[: state.rows, :, live]).all())  # pads too: masked, they must stay finite
            assert float(((mine[: state.rows, :, live] - theirs) * real).abs().max()) < EXACT
    assert torch.equal(state.next_pos, reference.next_pos)


def test_greedy_decoding_is_the_same_with_both_runners(tmp_path: Path) -> None:
    model_dir = sharp_tiny_model(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for decode in ("fast", "transformers"):
        engine = HFEngine(str(model_dir), decode=decode)
        tokens[decode] = {k: c.token_ids for k, c in by_key(list(engine.generate(PROMPTS, params))).items()}
        engine.close()
    assert tokens["fast"] == tokens["transformers"]
    for (p, _), ids in tokens["fast"].items():
        with torch.no_grad():  # each token is the argmax after the ones before it (EOS ignored, as asked)
            logits = reference(input_ids=torch.tensor([PROMPTS[p] + ids])).logits[0, len(PROMPTS[p]) - 1 : -1]
        assert logits.argmax(-1).tolist() == ids


def reference_layout(keys: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the transformers runner's state holds: compact [rows, heads, width, dim], columns of pads only trimmed."""
    used = mask.any(dim=0)
    first = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
    return keys[:, :, first:], mask[:, first:]


def test_kv_state_select_merge_and_growth_keep_the_transformers_layout() -> None:
    """Random joins (wider and narrower than the running rows), leaves and appended tokens: the live part of the
    buffers always equals the compact, left-padded cache the transformers runner keeps (pads as zeros)."""
    g = torch.Generator().manual_seed(0)

    def fresh(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.randint(1, 9, (rows,), generator=g)
        width = int(lengths.max())
        mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
        keys = torch.randn(rows, 2, width, 3, generator=g) * mask[:, None, :, None]
        return keys, mask

    keys, mask = fresh(3)
    state = KVState([keys.clone()], [-keys.clone()], mask.long(), torch.zeros(3, dtype=torch.long))
    for step in range(60):
        op = int(torch.randint(0, 3, (1,), generator=g))
        if op == 0:  # a token for every row
            column = state.append_column()
            new = torch.randn(len(keys), 2, 3, generator=g)
            state.keys[0][: len(keys), :, column] = new
            state.values[0][: len(keys), :, column] = -new
            keys, mask = torch.cat([keys, new[:, :, None]], 2), torch.cat([mask, mask.new_ones(len(keys), 1)], 1)
        elif op == 1 and len(keys) > 1:  # some rows leave
            index = torch.randperm(len(keys), generator=g)[: int(torch.randint(1, len(keys), (1,), generator=g))]
            index = index.sort().values
            state.select(index)
            keys, mask = reference_layout(keys[index], mask[index])
        else:  # rows join
            other_keys, other_mask = fresh(int(torch.randint(1, 4, (1,), generator=g)))
            other_pos = torch.zeros(len(other_keys), dtype=torch.long)
            state.merge(KVState([other_keys.clone()], [-other_keys.clone()], other_mask.long(), other_pos))
            width = max(keys.shape[2], other_keys.shape[2])
            keys = torch.cat([_pad_left(keys, width, dim=2), _pad_left(other_keys, width, dim=2)])
            mask = torch.cat([_pad_left(mask, width), _pad_left(other_mask, width)])
        live = slice(state.start, state.end)
        assert state.rows == len(keys) == len(state.next_pos), step
        assert torch.equal(state.mask[: state.rows, live], mask.bool()), step
        assert torch.equal(state.keys[0][: state.rows, :, live], keys), step
        assert torch.equal(state.values[0][: state.rows, :, live], -keys), step
        assert state.has_pads == (not bool(mask.all())), step


def build(config: PretrainedConfig, attn: str = "sdpa") -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: build(LLAMA, "flex_attention"), "attention implementation 'flex_attention'"),
        (lambda: build(MistralConfig(**SMALL, sliding_window=16)), "sliding-window attention"),
        (lambda: build(LlamaConfig(**SMALL, rope_parameters=DYNAMIC)), "rope type 'dynamic'"),
        (lambda: build(LlamaConfig(**SMALL, hidden_act="gelu")), "hidden_act 'gelu'"),
        (lambda: build(GPT2Config(vocab_size=23, n_embd=32, n_layer=1, n_head=2)), "model_type 'gpt2'"),
    ],
)
def test_unsupported_models_are_named_with_the_reason(model, reason) -> None:
    assert reason in unsupported_reason(model())


def test_supported_models_have_no_reason() -> None:
    linear = LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    # a window no sequence exceeds; RoPE scalings fixed at load (inv_freq, attention_scaling)
    for config in (LLAMA, MISTRAL, MistralConfig(**SMALL, sliding_window=64), LLAMA_YARN, linear, QWEN3):
        assert unsupported_reason(build(config)) is None
    assert unsupported_reason(build(LLAMA, "eager")) is None  # the same attention, computed without SDPA


def test_auto_falls_back_with_the_reason_and_fast_refuses(tmp_path: Path, caplog) -> None:
    supported = sharp_tiny_model(tmp_path / "qwen2")
    unsupported = write_model(tmp_path / "dynamic-rope", LlamaConfig(**SMALL, rope_parameters=DYNAMIC))
    with caplog.at_level(logging.INFO, logger="relayrl.rollout.hf"):
        assert HFEngine(str(supported)).decoder == "fast"
        assert HFEngine(str(unsupported)).decoder == "transformers"
    assert "fast Llama-family runner" in caplog.text and "rope type 'dynamic'" in caplog.text
    with pytest.raises(ValueError, match=r"rollout\.hf_decode.*rope type 'dynamic'"):
        HFEngine(str(unsupported), decode="fast")
    with pytest.raises(ValueError, match=r"rollout\.hf_decode.*got 'turbo'"):
        HFEngine(str(supported), decode="turbo")
