"""The embedded engine: a Hugging Face causal LM with batched sampling over a KV cache (runs on CPU).

Decoding is written here rather than through ``model.generate`` so that each token's logprob is computed
exactly as the trainer computes it (``logprobs_from_logits`` on the raw logits), rows finish independently
and are yielded at once, and weights can be swapped in place between calls.

Per chunk of at most ``max_batch_size`` rows (prompt x sample): each distinct prompt is prefilled once
(left-padded, position ids = cumsum(mask) - 1) and its KV cache rows are repeated for its samples; then one
token per step is fed with the cache, the attention mask grown by one column and the positions by one.
Finished rows are dropped from the batch (and the cache) at once.

Left padding leaves the pad positions' query rows fully masked; torch (>= 2.5) SDPA answers zeros for such
rows, not NaN, so the pads' cached keys/values stay finite and, masked, never reach a real token. The tests
check sdpa and eager against an unpadded forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Cache, GenerationConfig

from relayrl.rollout.engine import EngineCompletion, FinishReason, InferenceEngine
from relayrl.rollout.sampling import SamplingParams
from relayrl.trainer.algorithms.logprobs import logprobs_from_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine(InferenceEngine):
    """Transformers backend. ``seed`` seeds the engine's generator, used by requests that carry no seed."""

    name = "hf"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 256,
        attn_implementation: str = "sdpa",
        seed: int = 0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = self.model.config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model.generation_config)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # every name a state dict may use, tied aliases included (lm_head.weight -> the embedding)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """See ``InferenceEngine.generate``; rows are processed in chunks of ``max_batch_size``."""
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        abort = _AbortLatch(should_abort)
        rows = [(p, s) for p in range(len(prompts)) for s in range(params.n)]
        for start in range(0, len(rows), self.max_batch_size):
            chunk = [_Row(p, s) for p, s in rows[start : start + self.max_batch_size]]
            if abort():
                yield from (row.finish("abort") for row in chunk)
            else:
                yield from self._generate_chunk(prompts, chunk, params, generator, abort)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters themselves (so ``.data`` swaps reach the model); a tied weight once, first name."""
        yield from self.model.named_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See ``InferenceEngine.load_weights``; tensors are cast to the parameter's dtype and device."""
        pairs = list(weights)
        for name, tensor in pairs:
            if name not in self._params:
                raise ValueError(f"{name}: no such parameter in the model")
            expected = tuple(self._params[name].shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the parameter's {expected}")
        with torch.no_grad():
            for name, tensor in pairs:
                self._params[name].copy_(tensor)

    @torch.inference_mode()
    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        rows: list[_Row],
        params: SamplingParams,
        generator: torch.Generator,
        abort: _AbortLatch,
    ) -> Iterator[EngineCompletion]:
        """Decode all rows of one chunk step by step, yielding each as it finishes."""
        logits, state = self._prefill(prompts, rows)
        stop_ids = stop_token_set(self.eos_token_ids, params)
        held_back = torch.tensor(sorted(self.eos_token_ids | set(params.stop_token_ids)), device=self.device)
        for step in range(params.max_tokens):
            if abort():
                yield from (row.finish("abort") for row in rows)
                return
            tokens, logprobs = sample_step(
                logits, params, generator, banned=held_back if step < params.min_tokens else None
            )
            keep = []
            for i, (row, token, logprob) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)):
                row.token_ids.append(token)
                row.logprobs.append(logprob)
                if token in stop_ids:
                    yield row.finish("stop")
                elif step + 1 == params.max_tokens:
                    yield row.finish("length")
                else:
                    keep.append(i)
            if not keep:
                return
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                state.select(index)
                tokens, rows = tokens[index], [rows[i] for i in keep]
            logits = self._decode(state, tokens)

    def _prefill(self, prompts: Sequence[Sequence[int]], rows: list[_Row]) -> tuple[torch.Tensor, _DecodeState]:
        """Forward each distinct prompt of ``rows`` once, left-padded, then repeat its cache rows for its
        samples. Returns the last-position logits [len(rows), V] and the decoding state."""
        unique = sorted({row.prompt_index for row in rows})
        input_ids, mask = left_pad([prompts[p] for p in unique], self.device)
        positions = position_ids(mask)
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        slot = {p: i for i, p in enumerate(unique)}
        expand = torch.tensor([slot[row.prompt_index] for row in rows], device=self.device)
        state = _DecodeState(out.cache, mask, positions[:, -1] + 1)
        state.select(expand)
        return out.logits[expand, -1], state

    def _decode(self, state: _DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one new token per row [B] through the cache; returns the next logits [B, V]."""
        state.mask = torch.cat([state.mask, state.mask.new_ones(len(tokens), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=state.mask,
            position_ids=state.next_pos[:, None],
            cache=state.cache,
            use_cache=True,
        )
        state.next_pos = state.next_pos + 1
        return out.logits[:, -1]


@dataclass
class _DecodeState:
    """The rows being decoded: their KV cache, attention mask [B, T] (0 = left pad) and next position [B]."""

    cache: Cache
    mask: torch.Tensor
    next_pos: torch.Tensor

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) the rows at ``index``, in that order."""
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]


@dataclass
class _Row:
    """One sample being decoded."""

    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def finish(self, reason: FinishReason) -> EngineCompletion:
        return EngineCompletion(self.prompt_index, self.sample_index, self.token_ids, self.logprobs, reason)


class _AbortLatch:
    """``should_abort`` made sticky: once it has returned true, every later call returns true."""

    def __init__(self, should_abort: Callable[[], bool] | None) -> None:
        self._should_abort = should_abort
        self._fired = False

    def __call__(self) -> bool:
        self._fired = self._fired or (self._should_abort is not None and bool(self._should_abort()))
        return self._fired


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, max_len] int64, prompts aligned right; pads are id 0, mask 0."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: real tokens count from 0 whatever the padding before them."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus: the smallest set of most likely tokens whose mass reaches top_p.

    probs: [B, V]. The most likely token is always kept; the result is not renormalised.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def stop_token_set(eos_token_ids: frozenset[int], params: SamplingParams) -> frozenset[int]:
    """The tokens that end a response: the stop tokens, and EOS unless ``params.ignore_eos``."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def sample_step(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, banned: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from logits [B, V]: (tokens [B] int64, their logprobs [B] float32).

    temperature 0: argmax, logprob at temperature 1. Otherwise sample from softmax(logits / T) restricted to
    the top-p nucleus; the logprob is that of the full softmax(logits / T) (before top-p). ``banned`` token
    ids (``min_tokens`` not reached yet) cannot be picked; logprobs stay those of the unmasked logits.
    """
    scores = logits if banned is None else logits.index_fill(-1, banned, float("-inf"))
    if params.temperature == 0:
        tokens = scores.argmax(dim=-1)
        return tokens, logprobs_from_logits(logits, tokens, 1.0)
    probs = torch.softmax(scores.float() / params.temperature, dim=-1)
    tokens = torch.multinomial(top_p_filter(probs, params.top_p), 1, generator=generator).squeeze(-1)
    return tokens, logprobs_from_logits(logits, tokens, params.temperature)


def eos_token_ids(tokenizer: object, generation_config: GenerationConfig | None) -> frozenset[int]:
    """The tokenizer's EOS together with the generation config's (an int or a list)."""
    ids = {getattr(tokenizer, "eos_token_id", None)}
    configured = getattr(generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)
