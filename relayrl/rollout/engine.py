"""The inference-engine interface and the registry of backends (``hf``; ``vllm`` and ``sglang`` plug in here).

A rollout worker talks to one ``InferenceEngine``: it generates completions with per-token logprobs and
exposes its live weights so a weight update can be loaded in place. Requests reach ``generate`` already
validated (``relayrl.wire.sampling.validate_request``). The worker calls ``generate`` from several threads at
once (one per Generate call) and expects the engine to batch them (continuous batching); it never runs
``load_weights`` (or a weight update) while a ``generate`` call is in flight (pause, load, resume).
"""

from __future__ import annotations

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class EngineCompletion:
    """One sampled response: ``logprobs[i]`` is the logprob of ``token_ids[i]`` under the sampling distribution.

    finish_reason: "stop" (EOS or a stop token, included in ``token_ids``), "length" (``max_tokens`` reached)
    or "abort" (``should_abort`` turned true; ``token_ids`` holds what was generated so far).
    token_versions: the policy version that sampled each token, for a row that lived through a weight update;
    None: every token was sampled by the version the worker reports for the call.
    routed_experts: with routing replay (``algorithm.routing_replay``), the experts the engine's routers chose for
    every token it forwarded (the prompt's, then every sampled token but the last) as [tokens, layers, k] indices
    (``relayrl.algorithms.routing_replay``); None: not recorded.
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int] | None = None
    routed_experts: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillCounts:
    """Prompt tokens an engine has prefilled (forwarded) and taken from its prefix cache instead, since it started:
    reused / (computed + reused) is the cache's hit rate."""

    computed: int
    reused: int


class InferenceEngine(ABC):
    """A backend that samples completions and owns the policy weights.

    Attributes set by every backend: ``name`` (the registry name), ``vocab_size`` (size of the logits),
    ``max_model_len`` (context length: prompt + response), ``eos_token_ids`` and ``tokenizer`` (a Hugging Face
    tokenizer, used to decode text for information only).
    """

    name: ClassVar[str]
    # routing replay: bytes of routed experts per forwarded token (layers x k x index bytes); 0: none recorded
    routed_bytes_per_token: int = 0
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    tokenizer: Any

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """Sample ``params.n`` completions per prompt and yield each as soon as it is finished.

        Every (prompt_index, sample_index) is yielded exactly once. Once ``should_abort()`` returns true the
        unfinished ones are yielded with finish_reason "abort" and generation stops.
        """

    def generate_batches(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[list[EngineCompletion]]:
        """``generate``, grouped: each list holds completions that were ready together (at least one), so a
        server can send them in one message. The default groups nothing; engines that finish rows in steps
        override it."""
        for completion in self.generate(prompts, params, should_abort):
            yield [completion]

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live parameter tensors under their Hugging Face state-dict names; tied weights appear once.

        Live: in-place writes and ``.data`` swaps on them change what the engine generates with.
        """

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the live parameter of that name, in place and without autograd.

        May be called several times with disjoint subsets (one per bucket). An unknown name or a shape
        mismatch raises ValueError naming the parameter, before anything of this call is copied.
        """

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every tensor of ``named_weights``, in that order."""
        return [(name, tuple(t.shape), t.dtype) for name, t in self.named_weights()]

    # -- in-flight weight updates (rollout.partial; issue #28) -------------------------------------------
    supports_in_flight_update: ClassVar[bool] = False

    def pause_in_flight(self) -> None:
        """Freeze every row in flight at a step boundary, keeping its state (tokens, and KV where the engine
        keeps it), so that weights can be loaded under it; open ``generate`` calls stay open. Engines that
        cannot raise NotImplementedError naming themselves."""
        raise NotImplementedError(f"engine {self.name!r} cannot pause rows in flight")

    def resume_in_flight(self, version: int) -> None:
        """Continue the frozen rows on the weights loaded since ``pause_in_flight``; every token sampled from
        here on carries ``version`` in ``EngineCompletion.token_versions``."""
        raise NotImplementedError(f"engine {self.name!r} cannot resume rows in flight")

    # -- LoRA adapters (model.lora; issue #29) ----------------------------------------------------------
    supports_lora: ClassVar[bool] = False

    def load_adapter(self, name: str, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> int:
        """Install the adapter ``name`` (versioned, e.g. ``policy-v7``: never a reused name) from tensors under
        PEFT's unfused names (``...q_proj.lora_A.weight``); later ``generate`` calls use it. Returns how many
        modules it applies to, which the caller checks against what was sent. On any failure it raises and the
        previous adapter keeps serving."""
        raise NotImplementedError(f"engine {self.name!r} cannot load LoRA adapters")

    def weights_changed(self) -> None:  # noqa: B027 - optional hook, for engines with caches derived from weights
        """The live weights were changed in place or re-pointed (a weight update through ``named_weights``, not
        ``load_weights``): whatever the engine derived from the old ones (a prefix KV cache) must go. The worker
        calls it after every update, with no row running on the change (aborted, finished or frozen)."""

    def prefill_counts(self) -> PrefillCounts | None:
        """Prompt tokens prefilled and reused from a prefix cache (``PrefillCounts``); None: the engine does not
        count them."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing to release
        """Release the engine's resources (processes, device memory); the default does nothing."""


# name -> engine class, or "module:Class" imported on first use so heavy backends load only when chosen.
ENGINES: dict[str, type[InferenceEngine] | str] = {
    "hf": "relayrl.rollout.hf:HFEngine",
    "vllm": "relayrl.rollout.vllm:VLLMEngine",
    "sglang": "relayrl.rollout.sglang:SGLangEngine",
}


def engine_class(name: str) -> type[InferenceEngine]:
    """The class registered as ``name`` (importing it if registered lazily); ValueError listing known names."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(sorted(ENGINES))}") from None
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def worker_seed(run_seed: int, worker: str) -> int:
    """The engine seed of one rollout worker: ``run.seed`` mixed with the worker's identity (sha256, the same in
    every process and after a restart), in [0, 2**32) as vLLM's and SGLang's seeds must be. Seeding every
    worker with ``run.seed`` itself gave them all one random stream for requests without a seed: two workers
    handed chunks of the same shape drew the same uniforms row for row, so their samples were correlated."""
    digest = hashlib.sha256(f"{run_seed}:{worker}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def create_engine(name: str, **options: Any) -> InferenceEngine:
    """Instantiate the engine registered as ``name`` with ``options`` as keyword arguments."""
    return engine_class(name)(**options)
