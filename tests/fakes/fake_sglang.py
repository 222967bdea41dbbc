"""A fake ``sglang`` module (SGLang 0.5.23's API, the part relayrl's ``sglang`` adapter uses), generating with the
tiny model it loads.

Mirrored, with SGLang's names, signatures and return shapes: ``Engine(**server_args)`` with its event loop
``Engine.loop``; ``Engine.async_generate(..., input_ids, sampling_params, return_logprob, stream, rid, ...)``
(``stream=True``: an async generator of chunks ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "output_token_logprobs": [(logprob, token_id, None)]}, "index"}``, a
non-final chunk when an item is admitted and the final one when it finishes) and the synchronous
``Engine.generate`` over ``loop.run_until_complete``; a scheduler that batches continuously across calls (every
step advances every running item one token; ``steps`` records them); ``Engine.tokenizer_manager.context_len`` /
``abort_request(rid, abort_all)``; ``begin_weight_update`` / ``end_weight_update`` /
``update_weights_from_tensor(named_tensors, load_format, flush_cache)`` returning ``(success, message)``
(refused outside a session; a flush fails while requests run or wait; ``load_format`` None loads with the
model's ``load_weights``, one of ``custom_weight_loader`` is called as ``loader(model, named_tensors)`` once per
runner (target, and draft under ``speculative_algorithm``) on every scheduler, TP x PP, at once); ``shutdown``;
and ``sglang.srt.distributed.parallel_state``'s rank functions. Logprobs: log softmax(logits / T) before top-p
(T = 1 when greedy) and after the min-new-tokens penalizer, as SGLang's sampler returns them, by a
teacher-forced forward. ``sampling_seed`` counts only with ``enable_deterministic_inference`` (then 42 when
unset), as in SGLang. docs/engines.md lists each behaviour with its upstream file.

Stop strings as SGLang's ``Req.check_finished`` (sglang/srt/managers/schedule_batch.py): after the stop tokens,
each string of ``stop`` in order is looked for in the decoded output; a match ends the request with
``{"type": "stop", "matched": <string>}`` and ``output_ids`` keep every token (the text is not emulated: "").
Not emulated (NotImplementedError): penalties, top-k, min-p, n > 1, single (unbatched) input;
SGLang's fused parameter names and TP shards (every fake scheduler shares one full model with Hugging Face
names). Tests read ``Engine.server_args``, ``generate_calls``, ``steps``, ``tokenizer_manager.aborted``.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fakes.common import FakeEngineModel, PrefixCache, RoutedExpertsCapture, run_on_ranks, token_logprobs
from relayrl.rollout.hf import HFEngine, sample_step, stop_token_set
from relayrl.wire.sampling import SamplingParams as RelaySamplingParams

__version__ = "0.5.23+fake"
# What a test puts into sys.modules to stand in for SGLang (the adapter's loader imports the last one).
MODULES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.distributed",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.managers",
    "sglang.srt.managers.io_struct",
)
# sglang/srt/managers/scheduler_components/weight_updater.py: flush_cache_after_weight_update
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
SAMPLING_EPS = 1e-6  # sglang/srt/sampling/sampling_params.py: temperatures below are greedy
SERVER_ARGS = frozenset(  # the ServerArgs fields this fake understands (sglang/srt/arg_groups/fields/)
    {
        "model_path",
        "dtype",
        "random_seed",
        "max_running_requests",
        "custom_weight_loader",
        "tp_size",
        "pp_size",
        "context_length",
        "enable_deterministic_inference",
        "mem_fraction_static",
        "speculative_algorithm",
        "enable_return_routed_experts",
        "log_level",
        "weight_version",
        "enable_lora",
        "max_lora_rank",
        "lora_target_modules",
        "max_loras_per_batch",
        "page_size",
        "disable_radix_cache",
    }
)
SAMPLING_FIELDS = frozenset(  # sglang.srt.sampling.sampling_params.SamplingParams
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)
_NEUTRAL = {
    "top_k": (-1, 1 << 30),
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "n": (1,),
}


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    """sglang/srt/managers/io_struct.py: "abort" aborts every request; "in_place" freezes them in the running
    batch with their KV (a cache flush then fails); "retract" (not emulated) moves them back to the queue."""

    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    """sglang/srt/managers/io_struct.py: note the default, which aborts every running request."""

    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class LoRAUpdateOutput:
    """sglang/srt/managers/io_struct.py: what (un)loading an adapter returns."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


_rank = threading.local()  # the calling fake scheduler's tp_rank, tp_size, pp_rank


def get_tensor_model_parallel_rank() -> int:
    """The TP rank of the calling fake scheduler (a thread here, a process in SGLang)."""
    return _rank.tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return _rank.tp_size


def get_pipeline_model_parallel_rank() -> int:
    return _rank.pp_rank


class TokenizerManager:
    def __init__(self, context_len: int, engine: Engine) -> None:
        self.context_len = context_len
        self.aborted: list[str] = []
        self._engine = engine

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        """sglang/srt/managers/tokenizer_manager.py: ``pause_generation``; the scheduler's side is
        ``Scheduler.pause_generation`` (sglang/srt/managers/scheduler.py)."""
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
        elif obj.mode != "in_place":
            raise NotImplementedError(f"the fake does not emulate pause mode {obj.mode!r}")
        self._engine.paused = True

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self._engine.paused = False
        if self._engine._wake is not None:
            self._engine._wake.set()

    async def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> None:
        """sglang/srt/managers/tokenizer_control_mixin.py: ``update_weight_version``; the scheduler records the
        old version's end in every live request (``record_weight_version_change``,
        sglang/srt/utils/weight_versions.py)."""
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        self._engine.weight_version = obj.new_version

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if abort_all or rid:
            self.aborted.append("*" if abort_all else rid)

    def is_aborted(self, rid: str) -> bool:
        return "*" in self.aborted or rid in self.aborted


@dataclass
class _Item:
    """One batch item (a request) in the fake scheduler."""

    index: int
    rid: str
    prompt: list[int]
    params: dict[str, Any]
    logprob: bool
    outbox: asyncio.Queue
    generator: torch.Generator
    cache_salt: str | None = None
    lora_id: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, taken when it is sampled
    versions: list[str] = field(default_factory=list)  # the weight version that sampled each token
    kv_epochs: list[Any] = field(default_factory=list)  # the weights each KV position was computed under
    cached: int = 0  # prompt tokens served by the radix cache
    return_routed: bool = False
    routed: torch.Tensor | None = None  # return_routed_experts: the last step's routed experts

    def cache_key(self) -> Any:
        """``RadixKey``'s namespace: ``extra_key`` (+ LoRA id) and ``cache_salt`` (schedule_batch.py)."""
        return ("salt", self.cache_salt, "lora", self.lora_id)


class Engine:
    """The offline engine; kwargs are ServerArgs fields. ``dtype="auto"`` loads float32 (as the tiny models)."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - SERVER_ARGS)
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.server_args = types.SimpleNamespace(**kwargs)
        dtype = kwargs.get("dtype", "auto")
        self.hf = HFEngine(
            kwargs["model_path"],
            dtype="float32" if dtype == "auto" else dtype,
            seed=kwargs.get("random_seed") or 0,
            max_batch_size=kwargs.get("max_running_requests") or 256,
        )
        self.tokenizer_manager = TokenizerManager(kwargs.get("context_length") or self.hf.max_model_len, self)
        self.model = FakeEngineModel(self.hf.model)
        self.tp_size = kwargs.get("tp_size", 1)
        self.pp_size = kwargs.get("pp_size", 1)
        # sglang/srt/managers/scheduler_components/weight_updater.py: _select_runners ("all": target, then draft)
        self.runners = ["target", "draft"] if kwargs.get("speculative_algorithm") else ["target"]
        self.loop = asyncio.new_event_loop()  # Engine._ensure_event_loop (a fresh one: tests run in threads)
        self.max_running = kwargs.get("max_running_requests") or 256
        self.waiting: list[_Item] = []
        self.batch: list[_Item] = []
        self.steps: list[list[str]] = []  # the request ids of every scheduler step
        self._scheduler: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._seeds = torch.Generator().manual_seed(kwargs.get("random_seed") or 0)
        self.custom_weight_loaders = list(kwargs.get("custom_weight_loader") or [])
        self.deterministic = bool(kwargs.get("enable_deterministic_inference", False))
        self.generate_calls: list[dict[str, Any]] = []
        self.cache_flushes = 0
        self.closed = False
        self._session = False
        self.paused = False
        self.weight_version = kwargs.get("weight_version", "default")
        # sglang/srt/arg_groups/fields/exec_.py: enable_return_routed_experts
        self.routing = RoutedExpertsCapture(self.hf.model) if kwargs.get("enable_return_routed_experts") else None
        self.cache = PrefixCache(kwargs.get("page_size") or 1)  # the radix cache (page size 1)
        self.prefix_caching = not kwargs.get("disable_radix_cache", False)
        self.epoch = 0  # bumped by every weight load: which weights computed a KV position
        self.admissions: dict[str, tuple[int, int, bool]] = {}  # rid -> (prompt, cached, stale KV reused)
        self.lora_enabled = bool(kwargs.get("enable_lora"))
        self.loras: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}  # name -> (LoRA id, W + scale B A)
        self.lora_loads = 0
        self.hold_after: int | None = None  # test-only: the scheduler waits after this many steps until release()
        self.held = threading.Event()
        self._release: asyncio.Event | None = None

    def generate(
        self,
        prompt: list[str] | str | None = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        image_data: Any = None,
        return_logprob: list[bool] | bool | None = False,
        logprob_start_len: list[int] | int | None = None,
        top_logprobs_num: list[int] | int | None = None,
        lora_path: list[str | None] | None = None,
        return_routed_experts: bool = False,
        stream: bool = False,
        rid: list[str] | str | None = None,
        *,
        cache_salt: list[str] | str | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """The synchronous wrapper, as SGLang's: each chunk by ``self.loop.run_until_complete`` (so it cannot be
        used from two threads at once, nor while the loop runs elsewhere)."""
        kwargs = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        kwargs.update(prompt=prompt, image_data=image_data, lora_path=lora_path, top_logprobs_num=top_logprobs_num)
        kwargs.update(rid=rid, cache_salt=cache_salt)
        chunks = self.loop.run_until_complete(self.async_generate(**kwargs, stream=True))

        def wrapper() -> Iterator[dict]:
            while True:
                try:
                    yield self.loop.run_until_complete(chunks.__anext__())
                except StopAsyncIteration:
                    return

        if stream:
            return wrapper()
        return [c for c in wrapper() if c["meta_info"]["finish_reason"] is not None]

    async def async_generate(
        self,
        prompt: list[str] | str | None = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        image_data: Any = None,
        return_logprob: list[bool] | bool | None = False,
        logprob_start_len: list[int] | int | None = None,
        top_logprobs_num: list[int] | int | None = None,
        lora_path: list[str | None] | None = None,
        return_routed_experts: bool = False,
        stream: bool = False,
        rid: list[str] | str | None = None,
        *,
        cache_salt: list[str] | str | None = None,
    ) -> Any:
        """``stream=True``: an async generator of chunks (a non-final chunk when an item is admitted, its final
        chunk when it finishes, items interleaved as the scheduler finishes them); otherwise the final chunks."""
        if prompt is not None or image_data is not None or top_logprobs_num:
            raise NotImplementedError("the fake sglang generates from input_ids only, without top logprobs")
        if not input_ids or not isinstance(input_ids[0], list):
            raise NotImplementedError("the fake sglang takes a batch: input_ids as a list of token-id lists")
        count = len(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * count
        rids = rid if isinstance(rid, list) else [f"fake-{i}" for i in range(count)]
        salts = cache_salt if isinstance(cache_salt, list) else [cache_salt] * count
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * count
        unknown = sorted({a for a in adapters if a is not None and a not in self.loras})
        if unknown:  # tokenizer_manager._validate_and_resolve_lora
            raise ValueError(f"The following requested LoRA adapters are not loaded: {unknown}")
        for item in params:
            self._check_sampling(item)
        self.generate_calls.append(
            {
                "input_ids": input_ids,
                "sampling_params": params,
                "return_logprob": return_logprob,
                "rid": rids,
                "cache_salt": salts,
                "lora_path": adapters,
            }
        )
        if return_routed_experts and self.routing is None:  # scheduler.py refuses it so
            raise ValueError("return_routed_experts needs the server started with --enable-return-routed-experts")
        self._ensure_scheduler()
        outbox: asyncio.Queue = asyncio.Queue()
        for index, (ids, item, request_id, salt) in enumerate(zip(input_ids, params, rids, salts, strict=True)):
            logprob = bool(return_logprob)
            generator = self._seed(item)
            new = _Item(index, request_id, list(ids), item, logprob, outbox, generator, salt)
            new.lora_id = self.loras[adapters[index]][0] if adapters[index] is not None else None
            new.return_routed = return_routed_experts
            self.waiting.append(new)
        self._wake.set()
        chunks = self._stream(outbox, count)
        if stream:
            return chunks
        return [c async for c in chunks if c["meta_info"]["finish_reason"] is not None]

    @staticmethod
    async def _stream(outbox: asyncio.Queue, count: int) -> Any:
        finished = 0
        while finished < count:
            chunk = await outbox.get()
            finished += chunk["meta_info"]["finish_reason"] is not None
            yield chunk

    @property
    def running(self) -> int:
        """Requests admitted or queued and not finished (what makes a cache flush fail)."""
        return len(self.waiting) + len(self.batch)

    def _seed(self, item: dict[str, Any]) -> torch.Generator:
        """Under deterministic inference the request's ``sampling_seed``, 42 when it has none (same seed, same
        sample); otherwise the engine's own random stream."""
        if self.deterministic:
            seed = item.get("sampling_seed") if item.get("sampling_seed") is not None else 42
        else:
            seed = int(torch.randint(1 << 62, (1,), generator=self._seeds))
        return torch.Generator().manual_seed(seed)

    def _ensure_scheduler(self) -> None:
        """The scheduler task, started on the running loop by the first request (as ``auto_create_handle_loop``)."""
        if self._scheduler is None or self._scheduler.done():
            self._wake = asyncio.Event()
            self._release = asyncio.Event()
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        """Continuous batching: every step advances every running item by one token; waiting items (of any
        call) join between steps, up to ``max_running_requests``; aborted items finish with what they have."""
        while True:
            if self.paused or (not self.waiting and not self.batch):
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.hold_after is not None and len(self.steps) == self.hold_after:
                self.hold_after = None
                self.held.set()
                await self._release.wait()
                continue
            while self.waiting and len(self.batch) < self.max_running:
                item = self.waiting.pop(0)
                self._admit(item)
                self.batch.append(item)
                item.outbox.put_nowait(self._chunk(item, None))
            self.steps.append([item.rid for item in self.batch])
            still = []
            for item in self.batch:
                finish = self._advance(item)
                if finish is None:
                    still.append(item)
                else:
                    if self.prefix_caching:  # a finished request's sequence stays in the radix tree
                        self.cache.insert(item.prompt + item.tokens, item.kv_epochs, item.cache_key())
                    item.outbox.put_nowait(self._chunk(item, finish))
            self.batch = still
            await asyncio.sleep(0)

    def _admit(self, item: _Item) -> None:
        """Prefill: the radix cache serves what it holds for the prompt (under the item's key), the rest is
        computed under the current weights and inserted."""
        served = self.cache.match(item.prompt, item.cache_key()) if self.prefix_caching else []
        item.cached = len(served)
        item.kv_epochs = served + [self.epoch] * (len(item.prompt) - len(served))
        self.admissions[item.rid] = (len(item.prompt), item.cached, any(e != self.epoch for e in served))
        if self.prefix_caching:
            self.cache.insert(item.prompt, item.kv_epochs, item.cache_key())

    @torch.no_grad()
    def _advance(self, item: _Item) -> dict[str, Any] | None:
        """One token for ``item``; its finish reason when it is done (SGLang's ``FINISH_*.to_json``)."""
        if self.tokenizer_manager.is_aborted(item.rid):
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        params = item.params
        temperature = params.get("temperature", 1.0)
        relay = RelaySamplingParams(
            temperature=0.0 if temperature < SAMPLING_EPS else temperature,
            top_p=params.get("top_p", 1.0),
            max_tokens=params.get("max_new_tokens", 128),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            min_tokens=params.get("min_new_tokens") or 0,
            ignore_eos=bool(params.get("ignore_eos")),
        )
        ids = torch.tensor([item.prompt + item.tokens])
        adapted = next((w for lora_id, w in self.loras.values() if lora_id == item.lora_id), None)
        if adapted is None:
            logits = self.hf.model(input_ids=ids).logits[:, -1]
        else:
            out = torch.func.functional_call(self.hf.model, adapted, (), {"input_ids": ids}, strict=False)
            logits = out.logits[:, -1]
        if self.routing is not None:
            routed = self.routing.take()
            item.routed = routed if item.return_routed else None
        banned = None
        if len(item.tokens) < relay.min_tokens:
            banned = torch.tensor(sorted(self.hf.eos_token_ids | set(relay.stop_token_ids)))
        token = int(sample_step(logits, relay, item.generator, banned=banned)[0][0])
        if item.logprob:
            item.logprobs.append(self._logprob(logits.float(), token, params, len(item.tokens)))
        if item.tokens:
            item.kv_epochs.append(self.epoch)  # this step computed the KV of the previous token
        item.tokens.append(token)
        item.versions.append(self.weight_version)
        if token in stop_token_set(self.hf.eos_token_ids, relay):
            return {"type": "stop", "matched": token}
        stops = params.get("stop") or []
        text = self.hf.tokenizer.decode(item.tokens) if stops else ""
        for stop in [stops] if isinstance(stops, str) else stops:
            if stop in text:
                return {"type": "stop", "matched": stop}
        if len(item.tokens) >= relay.max_tokens:
            return {"type": "length", "length": relay.max_tokens}
        return None

    @staticmethod
    def _check_sampling(item: dict[str, Any]) -> None:
        unknown = sorted(set(item) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        bad = [key for key, ok in _NEUTRAL.items() if key in item and item[key] not in ok]
        if bad:
            raise NotImplementedError(f"the fake sglang does not emulate sampling_params {bad}")

    def _logprob(self, logits: torch.Tensor, token: int, item: dict[str, Any], position: int) -> float:
        """As SGLang's sampler, at the step that samples ``token``: after the min-new-tokens penalizer (EOS and
        stop tokens at -inf for the first ``min_new_tokens`` positions: sglang/srt/sampling/penaltylib/
        min_new_tokens.py), before top-p. (A request frozen in place through a weight update gets its later
        logits from a full forward with the new weights: the fake recomputes where SGLang keeps the old KV.)"""
        temperature = item.get("temperature", 1.0)
        effective = 1.0 if temperature < SAMPLING_EPS else temperature
        if position < (item.get("min_new_tokens") or 0):
            logits[:, sorted(self.hf.eos_token_ids | set(item.get("stop_token_ids") or ()))] = float("-inf")
        return token_logprobs(logits, [token], effective)[0]

    @staticmethod
    def _chunk(item: _Item, finish: dict | None) -> dict[str, Any]:
        """A chunk of ``item`` (the final one when ``finish``): tokens so far, ``cached_tokens``, and the weight
        version spans (``add_weight_versions_to_meta_info``, sglang/srt/utils/weight_versions.py)."""
        tokens = item.tokens if finish is not None else []
        logprobs = item.logprobs if finish is not None and item.logprob else []
        spans: list[dict[str, Any]] = []
        for index, version in enumerate(item.versions if finish is not None else []):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = index + 1
            else:
                spans.append({"version": version, "start": index, "end": index + 1})
        meta = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.prompt),
            "completion_tokens": len(tokens),
            "cached_tokens": item.cached,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, tokens, strict=True)]
            if item.logprob
            else [],
        }
        if spans:
            meta.update(weight_versions=spans, weight_version=spans[-1]["version"])
        if finish is not None and item.routed is not None:  # tokenizer_manager.py: base64 of the int32 rows
            meta["routed_experts"] = base64.b64encode(item.routed.numpy().astype(np.int32).tobytes()).decode()
        return {"text": "", "output_ids": list(tokens), "meta_info": meta, "index": item.index}

    def load_lora_adapter_from_tensors(
        self, lora_name: str, tensors: dict[str, torch.Tensor], config_dict: dict, load_format: str | None = None
    ) -> LoRAUpdateOutput:
        """sglang/srt/entrypoints/engine.py -> tokenizer_control_mixin.py: ``load_lora_adapter_from_tensors`` (the
        tensors are serialized to the schedulers: copies); a new ``LoRARef`` id per load (the radix key), a name
        already loaded refused (lora_manager.py: ``validate_new_adapter``). Served as W + scale B A on the modules
        the names match (unfused Hugging Face names here; SGLang also takes fused ones)."""
        if not self.lora_enabled:
            return LoRAUpdateOutput(success=False, error_message="LoRA is not enabled. Please set `--enable-lora`.")
        if lora_name in self.loras:
            message = f"Failed to load LoRA adapter {lora_name} because it is already loaded"
            return LoRAUpdateOutput(success=False, error_message=message)
        rank, alpha = config_dict["r"], config_dict["lora_alpha"]
        scale = alpha / rank**0.5 if config_dict.get("use_rslora") else alpha / rank
        params = dict(self.hf.model.named_parameters())
        weights = {}
        for name, a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                if f"{module}.weight" in params:
                    weights[f"{module}.weight"] = params[f"{module}.weight"].detach() + scale * b.float() @ a.float()
        self.lora_loads += 1
        self.loras[lora_name] = (f"lora-{self.lora_loads}", weights)
        return LoRAUpdateOutput(success=True, loaded_adapters={n: n for n in self.loras})

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        if self.loras.pop(lora_name, None) is None:
            return LoRAUpdateOutput(success=False, error_message=f"LoRA adapter {lora_name} is not loaded")
        return LoRAUpdateOutput(success=True, loaded_adapters={n: n for n in self.loras})

    def release(self) -> None:
        """Test-only: let a scheduler held by ``hold_after`` go on (thread-safe)."""
        self.loop.call_soon_threadsafe(self._release.set)

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = False
        return True, "Success"

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Load ``named_tensors`` on every TP rank at once (SGLang's own loader, or a registered custom one)."""
        if not self._session:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        if load_format is None:
            loader = FakeEngineModel.load_weights
        elif load_format in self.custom_weight_loaders:
            module_name, _, func_name = load_format.rpartition(".")
            loader = getattr(__import__(module_name, fromlist=[func_name]), func_name)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")

        def on_rank(rank: int) -> None:
            _rank.pp_rank, _rank.tp_rank = divmod(rank, self.tp_size)
            _rank.tp_size = self.tp_size
            for _runner in self.runners:
                loader(self.model, [(name, t.to("cpu")) for name, t in named_tensors])

        run_on_ranks(self.tp_size * self.pp_size, on_rank)
        self.epoch += 1
        if flush_cache:
            if self.running:
                return False, FLUSH_REFUSED
            self.cache_flushes += 1
            self.cache.reset()
        return True, "Success"

    def shutdown(self) -> None:
        """Real SGLang kills its scheduler process; the fake ends its scheduler task (the adapter shuts down
        between calls, with the loop stopped) so that nothing is left pending when the loop is collected."""
        self.closed = True
        if self._scheduler is not None and not self.loop.is_running():
            self._scheduler.cancel()
            self.loop.run_until_complete(asyncio.gather(self._scheduler, return_exceptions=True))
