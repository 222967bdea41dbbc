"""What both fakes share: the models their fake workers hold, thread-parallel fake RPCs, teacher-forced logprobs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.algorithms.routing_replay import RoutingRecorder


class RoutedExpertsCapture:
    """The routed experts both engines return with ``enable_return_routed_experts`` (vLLM's
    ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``, SGLang's
    ``sglang/srt/state_capturer/routed_experts.py``): every token of the sequence but the last, [tokens, layers,
    top_k]. The fakes forward the whole sequence at every step, so the routers' choices in the step that sampled
    the last token are those rows."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.recorder = RoutingRecorder(model)

    def take(self) -> torch.Tensor:
        """[tokens, layers, top_k] of the one-row forward just run."""
        return self.recorder.take(1)[0]


class FakeEngineModel:
    """The model inside a fake engine process: ``load_weights`` as vLLM's and SGLang's models have it (an
    iterable of (name, tensor) in Hugging Face names; an unknown name raises KeyError, as their
    ``params_dict[name]`` does). Unlike the real engines it keeps Hugging Face names and the full, unsharded
    tensors. Fake ranks share one instance; loads are serialised."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._params = dict(module.named_parameters(remove_duplicate=False))
        self._lock = threading.Lock()
        self.loaded_names: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                self._params[name].copy_(tensor)
                loaded.add(name)
                self.loaded_names.append(name)
        return loaded

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()


# vllm/model_executor/models/qwen2.py: Qwen2ForCausalLM.packed_modules_mapping (SGLang fuses the same way)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # vllm/model_executor/layers/linear.py: RowParallelLinear
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")  # vocab_parallel_embedding.py
VOCAB_PADDING = 64  # vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE


class FusedShardModel:
    """One tensor-parallel rank's model as vLLM (and SGLang) hold it, for a Llama-family checkpoint: q/k/v fused
    into ``qkv_proj`` and gate/up into ``gate_up_proj``, each piece split on dim 0 across ranks (column
    parallel); ``o_proj``/``down_proj`` split on dim 1 (row parallel); embeddings padded to a multiple of 64 rows
    and split by vocabulary; norms replicated; a tied ``lm_head`` is the embedding, listed once.

    ``load_weights`` takes Hugging Face names, as ``Qwen2Model.load_weights`` does (its ``stacked_params_mapping``;
    ``rotary_emb.inv_freq`` and a tied ``lm_head.weight`` skipped; an unknown name raises KeyError as
    ``params_dict[name]`` does) and returns the engine names it loaded. Loads are serialised.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {key: list(pieces) for key, pieces in PACKED.items()}

    def __init__(self, hf_params: Mapping[str, torch.Tensor], rank: int, tp_size: int, *, tied: bool) -> None:
        self.rank, self.tp_size, self.tied = rank, tp_size, tied
        self.params: dict[str, torch.Tensor] = {}
        # Hugging Face name -> (engine name, dim, offset in the engine tensor, start in the HF tensor, length)
        self.layout: dict[str, tuple[str, int, int, int, int]] = {}
        shapes = {name: tuple(t.shape) for name, t in hf_params.items()}
        for name, shape in shapes.items():
            self.layout[name] = self._place(name, shape, shapes)
        self._lock = threading.Lock()
        self.loaded_names: list[str] = []
        self.load_weights(hf_params.items())
        self.loaded_names.clear()

    def _split(self, length: int, name: str) -> int:
        if length % self.tp_size:
            raise NotImplementedError(f"the fake cannot split {name} ({length}) over {self.tp_size} ranks")
        return length // self.tp_size

    def _place(self, name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]):
        """Where this rank keeps its part of HF tensor ``name``; allocates the engine tensor on first use."""
        for fused, pieces in PACKED.items():
            piece = next((p for p in pieces if f".{p}." in name), None)
            if piece is not None:
                engine_name = name.replace(piece, fused)
                rows = [self._split(shapes[name.replace(piece, p)][0], name) for p in pieces]
                index = pieces.index(piece)
                self._alloc(engine_name, (sum(rows), *shape[1:]))
                return engine_name, 0, sum(rows[:index]), self.rank * rows[index], rows[index]
        if name.endswith(ROW_PARALLEL):
            cols = self._split(shape[1], name)
            self._alloc(name, (shape[0], cols))
            return name, 1, 0, self.rank * cols, cols
        if name.endswith(VOCAB_PARALLEL):
            per = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING // self.tp_size
            start = min(self.rank * per, shape[0])  # a rank past the vocabulary holds padding only
            self._alloc(name, (per, *shape[1:]))
            return name, 0, 0, start, max(0, min(per, shape[0] - start))
        self._alloc(name, shape)
        return name, 0, 0, 0, shape[0]

    def _alloc(self, engine_name: str, shape: tuple[int, ...]) -> None:
        if engine_name not in self.params:
            self.params[engine_name] = torch.zeros(shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                    continue
                engine_name, dim, offset, start, length = self.layout[name]
                target = self.params[engine_name].narrow(dim, offset, length)
                target.copy_(tensor.narrow(dim, start, length))
                loaded.add(engine_name)
                self.loaded_names.append(name)
        return loaded

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    @staticmethod
    def gather(ranks: Sequence[FusedShardModel]) -> dict[str, torch.Tensor]:
        """The full Hugging Face tensors the ranks hold together (what the fake engine generates with)."""
        out = {}
        for name, (engine_name, dim, offset, _, _) in ranks[0].layout.items():
            parts = [r.params[engine_name].narrow(dim, offset, r.layout[name][4]) for r in ranks]
            replicated = len({r.layout[name][3] for r in ranks}) == 1  # every rank holds the whole tensor
            out[name] = parts[0] if replicated else torch.cat(parts, dim=dim)
        return out


def run_on_ranks(ranks: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(rank)`` for every rank at once (threads stand in for the engine's processes); results in rank
    order. Collectives between the ranks work because they run concurrently, as in the real engine."""
    with ThreadPoolExecutor(max_workers=ranks) as pool:
        futures = [pool.submit(call, rank) for rank in range(ranks)]
        return [f.result() for f in futures]


@torch.no_grad()
def teacher_forced_logits(module: torch.nn.Module, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """Logits [len(response), V] (float32) that predicted each response token, from one full forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    return module(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()


def vllm_top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's top-p masking (``apply_top_k_top_p_pytorch``): sort ascending, mask the tokens whose cumulative
    probability is <= 1 - top_p (never the most likely one) with -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mask = cumulative <= 1 - top_p
    mask[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / temperature)[token] per position."""
    return logprobs_from_logits(logits, torch.tensor(list(tokens)), temperature).tolist()


class PrefixCache:
    """The engines' prefix caches, by what they key on: vLLM's automatic prefix caching (hashes of full blocks of
    ``block_size`` tokens, chained from the first block; the extra keys (LoRA name and path on every block,
    ``cache_salt`` on the first) make one chain per key, ``vllm/v1/core/kv_cache_utils.py``:
    ``generate_block_hash_extra_keys``, ``hash_block_tokens``) and SGLang's radix cache (``block_size`` 1, keyed by
    ``extra_key`` + LoRA id + ``cache_salt``, ``sglang/srt/managers/schedule_batch.py``: ``RadixKey``). A hit never
    covers the last prompt token (vLLM ``max_cache_hit_length = num_tokens - 1``, ``kv_cache_manager.py``; SGLang
    ``_compute_max_prefix_len``).

    Each cached block remembers the weights epochs its KV was computed under, so that a test can see a request
    reuse KV of other weights (what a missing flush or salt serves)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[tuple, tuple] = {}  # (key, token prefix) -> the epoch of each position's KV

    def match(self, tokens: Sequence[int], key: Any) -> list[Any]:
        """The epochs of the KV the cache serves for ``tokens``, position by position (its length is the hit)."""
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        epochs: list[Any] = []
        for end in range(self.block_size, limit + 1, self.block_size):
            block = self._blocks.get((key, tuple(tokens[:end])))
            if block is None:
                break
            epochs.extend(block)
        return epochs

    def insert(self, tokens: Sequence[int], kv_epochs: Sequence[Any], key: Any) -> None:
        """Cache every full block of ``tokens`` whose KV was computed (``kv_epochs[i]``: under which weights)."""
        for end in range(self.block_size, len(kv_epochs) + 1, self.block_size):
            self._blocks.setdefault((key, tuple(tokens[:end])), tuple(kv_epochs[end - self.block_size : end]))

    def reset(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)
