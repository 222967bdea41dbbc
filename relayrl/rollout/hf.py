"""The embedded engine: a Hugging Face causal LM with continuously batched sampling over a KV cache (CPU or GPU).

Decoding is written here rather than through ``model.generate`` so that each token's logprob is computed
exactly as the trainer computes it (``logprobs_from_logits`` on the raw logits), rows finish independently
and are yielded at once, and weights can be swapped in place between calls.

Concurrent ``generate`` calls share decode steps (``relayrl.rollout.batcher``): each joining prompt is
prefilled once (left-padded, position ids = cumsum(mask) - 1), its KV cache rows are repeated for its
samples and merged into the running batch (left-padded to a common width); then one token per step is fed
with the cache, the attention mask grown by one column and the positions by one. Finished rows leave the
batch (and the cache) at once; columns that only pads still use are trimmed.

A turn of an agentic episode (the conversation so far as its prompt) prefills only its new tokens: finished rows'
KV is kept in a prefix cache (``relayrl.rollout.prefix_cache``, ``rollout.prefix_cache_tokens``) that every weight
change flushes (``load_weights``, ``load_adapter``, ``weights_changed``, ``resume_in_flight``).

In-flight weight updates (``rollout.partial``): ``pause_in_flight`` parks the decode loop between two steps
with every row's tokens and KV cache kept; the weights are loaded in place (or re-pointed) under it; and
``resume_in_flight(version)`` continues the same rows, re-prefilled on the new weights (``partial="recompute"``,
as AReaL) or on their kept KV (``"keep_kv"``, as PipelineRL). Each token carries the version that sampled it
(``relayrl.rollout.batcher``).

Left padding leaves the pad positions' query rows fully masked; torch (>= 2.5) SDPA answers zeros for such
rows, not NaN, so the pads' cached keys/values stay finite and, masked, never reach a real token. The tests
check sdpa and eager against an unpadded forward, with rows of several calls batched together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Cache, DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.algorithms.routing_replay import RoutingRecorder
from relayrl.algorithms.routing_replay import unsupported_reason as routing_unsupported
from relayrl.rollout.batcher import MIN_SHARED_BEGINNING, ContinuousBatcher
from relayrl.rollout.engine import EngineCompletion, InferenceEngine, PrefillCounts
from relayrl.rollout.llama_decode import LlamaDecodeRunner, unsupported_reason
from relayrl.rollout.lora import AdapterSlots
from relayrl.rollout.padding import cached_prefix_layout, left_pad, left_pad_kv, position_ids
from relayrl.rollout.prefix_cache import CachedPrefix, PrefixCache
from relayrl.runtime.attention import AUTO, load_with_attention, resolved
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODERS = ("auto", "fast", "transformers")
PARTIAL = ("off", "recompute", "keep_kv")


class HFEngine(InferenceEngine):
    """Transformers backend. ``seed`` seeds the engine's generator, used by requests that carry no seed.

    ``decode`` (config ``rollout.hf_decode``) picks the decode steps' runner: "fast" is ``LlamaDecodeRunner``
    (refused at start, with the reason, when ``llama_decode.unsupported_reason`` finds the model unsupported),
    "transformers" the model's own forward, "auto" the fast one whenever it is supported. ``threads``: torch
    intra-op threads of the decoding (scheduler) thread; the process's other threads then use one
    (``relayrl.rollout.intra_op``: why); None leaves torch's thread counts as they are. ``prefix_cache_tokens``:
    the prefix cache's budget in tokens (0: off); ``min_shared_beginning``: the fewest tokens a beginning common to
    prompts that join together is prefilled once from (``relayrl.rollout.batcher``). ``attn_implementation``:
    ``model.attn_implementation``, the trainer's too (``relayrl.runtime.attention``; "auto": the model's default).
    ``routing_replay``
    (``algorithm.routing_replay``): every completion reports the experts its tokens were routed to
    (``EngineCompletion.routed_experts``; refused on a model without replayable routers); the prefix cache is then
    off (``relayrl.rollout.batcher``: why).
    """

    name = "hf"
    supports_lora = True  # unmerged, on both runners (relayrl.rollout.lora)
    supports_in_flight_update = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 256,
        attn_implementation: str = AUTO,
        seed: int = 0,
        decode: str = "auto",
        threads: int | None = None,
        partial: str = "off",
        prefix_cache_tokens: int = 32768,
        min_shared_beginning: int = MIN_SHARED_BEGINNING,
        routing_replay: bool = False,
    ) -> None:
        if partial not in PARTIAL:
            raise ValueError(f"partial (rollout.partial): expected one of {', '.join(PARTIAL)}, got {partial!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        if decode not in DECODERS:
            raise ValueError(f"decode (rollout.hf_decode): expected one of {', '.join(DECODERS)}, got {decode!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.partial = partial
        self.max_batch_size = max_batch_size
        self.model = load_with_attention(
            AutoModelForCausalLM.from_pretrained, model_path, attn_implementation, dtype=DTYPES[dtype]
        )
        self.model.to(self.device).eval().requires_grad_(False)
        log.info(
            "hf engine: %s attention (model.attn_implementation=%s), %s weights",
            resolved(self.model), attn_implementation, dtype,
        )  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = self.model.config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model.generation_config)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # every name a state dict may use, tied aliases included (lm_head.weight -> the embedding)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._adapter = AdapterSlots(self.model)
        runner = self._runner(decode)
        self.decoder = "fast" if isinstance(runner, LlamaDecodeRunner) else "transformers"  # the one chosen
        self.routing = self._routing_recorder() if routing_replay else None
        if self.routing is not None:
            self.routed_bytes_per_token = self.routing.layers * self.routing.top_k * self.routing.dtype.itemsize
        self._prefix_cache = PrefixCache(0 if routing_replay else prefix_cache_tokens)
        self._logged_counts = PrefillCounts(0, 0)
        self._batcher = ContinuousBatcher(
            runner, max_rows=max_batch_size, generator=self._generator, threads=threads,
            prefix_cache=self._prefix_cache, routing=self.routing, min_shared_beginning=min_shared_beginning,
        )  # fmt: skip

    def _routing_recorder(self) -> RoutingRecorder:
        """The recorder of the routers' choices (routing replay), or a ValueError naming the key and the reason."""
        reason = routing_unsupported(self.model)
        if reason is not None:
            raise ValueError(f"routing_replay (algorithm.routing_replay): {reason}")
        log.info("hf engine: recording routed experts for routing replay; the prefix cache is off (every prompt "
                 "is prefilled in full, so each token's experts are recorded)")  # fmt: skip
        return RoutingRecorder(self.model)

    def _runner(self, decode: str) -> _HFRunner | LlamaDecodeRunner:
        """The runner ``decode`` asks for (class docstring); logs the choice and, for "auto", why."""
        runner = _HFRunner(self.model, self.device)
        reason = None if decode == "transformers" else unsupported_reason(self.model)
        if decode == "fast" and reason is not None:
            raise ValueError(f"decode=fast (rollout.hf_decode): this model is not supported: {reason}")
        if decode == "transformers" or reason is not None:
            why = "asked for" if decode == "transformers" else f"the fast runner does not support it: {reason}"
            log.info("hf engine: decoding with the transformers forward (rollout.hf_decode=%s; %s)", decode, why)
            return runner
        log.info("hf engine: decoding with the fast Llama-family runner (rollout.hf_decode=%s)", decode)
        return LlamaDecodeRunner(self.model, runner)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """See ``InferenceEngine.generate``; safe to call from several threads at once: all calls share the
        decode steps, at most ``max_batch_size`` rows at a time."""
        for batch in self.generate_batches(prompts, params, should_abort):
            yield from batch

    def generate_batches(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[list[EngineCompletion]]:
        """See ``InferenceEngine.generate_batches``: the rows of a call that finished by the same decode step
        come together."""
        held_back = torch.tensor(sorted(self.eos_token_ids | set(params.stop_token_ids)), device=self.device)
        stop_ids = stop_token_set(self.eos_token_ids, params)
        stop_strings = StopStrings(self.tokenizer, params.stop, params.min_tokens) if params.stop else None
        yield from self._batcher.submit(prompts, params, stop_ids, held_back, should_abort, stop_strings).batches()

    def pause_in_flight(self) -> None:
        """See ``InferenceEngine.pause_in_flight``: the decode loop parks between two steps (module docstring)."""
        self._batcher.pause()

    def resume_in_flight(self, version: int) -> None:
        """See ``InferenceEngine.resume_in_flight``: the rows continue, re-prefilled first under
        ``partial="recompute"``, on their kept KV otherwise; the prefix cache is flushed first."""
        self.weights_changed()
        self._batcher.resume(version, recompute=self.partial == "recompute")

    def weights_changed(self) -> None:
        """See ``InferenceEngine.weights_changed``: the prefix cache is flushed (its KV came from the old weights)."""
        dropped, counts = self._prefix_cache.flush(), self.prefill_counts()
        if counts != self._logged_counts:  # once per update, however many buckets it loads
            self._logged_counts = counts
            log.info(
                "weights changed: prefix cache flushed (%d entries); prompt tokens so far: %d prefilled, "
                "%d from the prefix cache",
                dropped,
                counts.computed,
                counts.reused,
            )

    def prefill_counts(self) -> PrefillCounts:
        """See ``InferenceEngine.prefill_counts``."""
        return PrefillCounts(self._batcher.prefill_tokens, self._batcher.reused_tokens)

    def close(self) -> None:
        self._batcher.close()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters themselves (so ``.data`` swaps reach the model); a tied weight once, first name."""
        yield from self.model.named_parameters()

    def load_adapter(self, name: str, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> int:
        """See ``InferenceEngine.load_adapter`` (``relayrl.rollout.lora.AdapterSlots.load``); flushes the prefix
        cache."""
        try:
            return self._adapter.load(name, spec, tensors)
        finally:
            self.weights_changed()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See ``InferenceEngine.load_weights``; tensors are cast to the parameter's dtype and device; flushes the
        prefix cache."""
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
        self.weights_changed()


class _HFRunner:
    """Prefill and decode steps of a causal LM over a KV cache, for ``ContinuousBatcher``.

    The cache keeps every column of every layer (``DynamicCache()``: full-attention layers), sliding-window layers
    too: the model's own mask functions then apply each layer's window over the columns, which is its window over
    positions wherever a row's real tokens sit in consecutive columns (left padding; rows merged, trimmed, grown
    one column a step). transformers' sliding-window layer would instead drop the columns before the window, which
    rows of different lengths padded to one width cannot share. Rows continuing cached prefixes of a windowed
    model are prefilled in groups of one suffix length (``prefill_cached``), so that no pads sit between a row's
    prefix and its suffix."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        # whether any layer attends within a sliding window (the cache transformers would build for it says)
        self.windowed = any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers)

    def prefill(self, prompts: Sequence[Sequence[int]], expand: torch.Tensor) -> tuple[torch.Tensor, _DecodeState]:
        """Forward each prompt once, left-padded; row i continues prompt ``expand[i]``. Returns the last-position
        logits [len(expand), V] and the decoding state of those rows."""
        input_ids, mask = left_pad(prompts, self.device)
        positions = position_ids(mask)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
        )
        state = _DecodeState(out.cache, mask, positions[:, -1] + 1)
        state.select(expand)
        return out.logits[expand, -1], state

    def prefill_cached(
        self, prefixes: Sequence[CachedPrefix], suffixes: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, _DecodeState]:
        """Forward each suffix through a cache holding its prefix's KV (``padding.cached_prefix_layout``; the
        model's causal mask over cache + suffixes, restricted to the attention mask). Returns the logits [B, V] and
        the rows' decoding state. A windowed model's rows go in groups of one suffix length (class docstring),
        their states merged and put back in order."""
        lengths = sorted({len(s) for s in suffixes})
        if not self.windowed or len(lengths) == 1:
            return self._prefill_cached(prefixes, suffixes)
        groups = [[i for i, s in enumerate(suffixes) if len(s) == length] for length in lengths]
        logits, state = self._prefill_cached([prefixes[i] for i in groups[0]], [suffixes[i] for i in groups[0]])
        for group in groups[1:]:
            more_logits, more = self._prefill_cached([prefixes[i] for i in group], [suffixes[i] for i in group])
            logits = torch.cat([logits, more_logits])
            state.merge(more)
        at = {row: position for position, row in enumerate(i for group in groups for i in group)}
        order = torch.tensor([at[row] for row in range(len(suffixes))], device=self.device)
        state.select(order)
        return logits[order], state

    def _prefill_cached(
        self, prefixes: Sequence[CachedPrefix], suffixes: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, _DecodeState]:
        """``prefill_cached`` in one forward."""
        input_ids, mask, positions = cached_prefix_layout([len(p.tokens) for p in prefixes], suffixes, self.device)
        past = mask.shape[1] - input_ids.shape[1]
        cache = DynamicCache()
        for layer in range(len(prefixes[0].keys)):
            keys = left_pad_kv([p.keys[layer] for p in prefixes], past)
            cache.update(keys, left_pad_kv([p.values[layer] for p in prefixes], past), layer)
        mask = mask.long()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1], _DecodeState(out.cache, mask, positions[:, -1] + 1)

    @staticmethod
    def row_kv(state: _DecodeState, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row ``row``'s keys and values at its last ``length`` real cache columns (pads skipped), per
        layer [kv_heads, length, head_dim]."""
        real = state.mask[row].nonzero().squeeze(1)[-length:]
        layers = state._layers()
        return [la.keys[row][:, real] for la in layers], [la.values[row][:, real] for la in layers]

    def decode(self, state: _DecodeState, tokens: torch.Tensor) -> torch.Tensor:
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

    @staticmethod
    def sample(
        logits: torch.Tensor,
        params: SamplingParams,
        generators: Sequence[torch.Generator],
        banned: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample_step`` with one generator for the slice, or one per row (seeded requests)."""
        return sample_step(logits, params, generators[0] if len(generators) == 1 else generators, banned)


@dataclass
class _DecodeState:
    """The rows being decoded: their KV cache, attention mask [B, T] (0 = pad) and next position [B]."""

    cache: Cache
    mask: torch.Tensor
    next_pos: torch.Tensor

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) the rows at ``index``, in that order, then trim columns only pads still use."""
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        used = self.mask.any(dim=0)
        first = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]

    def merge(self, other: _DecodeState) -> None:
        """Append ``other``'s rows after this state's, both left-padded to the wider of the two."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width, dim=-2), _pad_left(theirs.keys, width, dim=-2)])
            mine.values = torch.cat([_pad_left(mine.values, width, dim=-2), _pad_left(theirs.values, width, dim=-2)])

    def _layers(self) -> list[DynamicLayer]:
        layers = self.cache.layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise NotImplementedError(
                f"continuous batching needs a full-attention KV cache; this model's cache has "
                f"{sorted({type(layer).__name__ for layer in layers})}"
            )
        return layers


def _pad_left(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


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


class StopStrings:
    """``checker(token_ids)``: whether a row's response now holds one of ``stop`` (``SamplingParams.stop``), called
    after each sampled token; never before ``min_tokens`` tokens (vLLM's detokenizer neither). The text checked is
    ``tokenizer.decode(skip_special_tokens=True)`` of the row's newest ``window`` tokens: an occurrence completed
    now holds the newest token (an older one ended the row before), and a string of c characters spans at most 4c
    byte-level tokens, so the window (4 x the longest string, plus 8 tokens of slack for a partial character at its
    start) holds it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], min_tokens: int = 0) -> None:
        self.tokenizer, self.stop, self.min_tokens = tokenizer, tuple(stop), min_tokens
        self.window = 4 * max(len(s) for s in stop) + 8

    def __call__(self, token_ids: list[int]) -> bool:
        if len(token_ids) <= self.min_tokens:
            return False
        text = self.tokenizer.decode(token_ids[-self.window :], skip_special_tokens=True)
        return any(s in text for s in self.stop)


def stop_token_set(eos_token_ids: frozenset[int], params: SamplingParams) -> frozenset[int]:
    """The tokens that end a response: the stop tokens, and EOS unless ``params.ignore_eos``."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def sample_step(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator],
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from logits [B, V]: (tokens [B] int64, their logprobs [B] float32).

    temperature 0: argmax, logprob at temperature 1. Otherwise sample from softmax(logits / T) restricted to
    the top-p nucleus; the logprob is that of the full softmax(logits / T) (before top-p). ``banned`` token
    ids (``min_tokens`` not reached yet) cannot be picked; logprobs stay those of the unmasked logits.
    ``generator``: one for every row, or one per row (``inverse_cdf``: a row's pick then depends on its own
    generator and logits alone).
    """
    scores = logits if banned is None else logits.index_fill(-1, banned, float("-inf"))
    if params.temperature == 0:
        tokens = scores.argmax(dim=-1)
        return tokens, logprobs_from_logits(logits, tokens, 1.0)
    probs = torch.softmax(scores.float() / params.temperature, dim=-1)
    tokens = inverse_cdf(top_p_filter(probs, params.top_p), generator)
    return tokens, logprobs_from_logits(logits, tokens, params.temperature)


def inverse_cdf(weights: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
    """One index per row of ``weights`` [B, V] (>= 0, unnormalised), drawn with probability proportional to its
    weight: the first index whose running sum exceeds u x (the row's total), u ~ U[0, 1) from ``generator`` (one
    for every row, or one per row), the target kept below the total where rounding would reach it. One random
    number a row, where ``torch.multinomial``'s without-replacement kernel draws one exponential per vocabulary
    entry. A zero-weight index never comes first: its running sum equals its predecessor's."""
    cdf = weights.cumsum(dim=-1)
    rows, device = weights.shape[0], weights.device
    if isinstance(generator, torch.Generator):
        u = torch.rand(rows, generator=generator, device=device)
    else:
        u = torch.cat([torch.rand(1, generator=g, device=device) for g in generator])
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)


def eos_token_ids(tokenizer: object, generation_config: GenerationConfig | None) -> frozenset[int]:
    """The tokenizer's EOS together with the generation config's (an int or a list)."""
    ids = {getattr(tokenizer, "eos_token_id", None)}
    configured = getattr(generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)
