"""The ``sglang`` engine: SGLang's offline ``sglang.Engine``, with relayrl's weight sync inside its schedulers.

Generation: every (prompt, sample) becomes one item of a single ``Engine.async_generate(input_ids=...,
sampling_params=[...], return_logprob=True, stream=True, rid=[...])`` call, streamed on SGLang's event loop by one
adapter thread, so concurrent calls reach SGLang's scheduler together and share its batches. Every item carries its own
``sampling_seed``: ``seed + sample_index`` for a seeded request, a fresh random one otherwise (under
``enable_deterministic_inference`` SGLang gives every seedless request seed 42, and its sampling noise depends
only on seed, position and vocabulary column, so the n samples of a prompt would all be the same).
``should_abort`` is checked between streamed chunks; then every unfinished item is aborted with
``tokenizer_manager.abort_request(rid=...)`` and the stream drained. Each item's final chunk carries
``output_ids`` and ``meta_info["output_token_logprobs"]`` = [(logprob, id, text)], logprobs of
log softmax(logits / T) before top-p: relayrl's convention.

Weights: SGLang runs no caller code in its schedulers but a registered custom weight loader (server argument
``custom_weight_loader``), which ``update_weights_from_tensor(..., load_format=<its import path>)`` calls as
``loader(model, named_tensors)`` in every scheduler (TP x PP). ``receive_in_scheduler`` is that loader: the one
named tensor's name carries the request (JSON); the scheduler joins relayrl's group as ``rank_offset +
pp_rank * tp_size + tp_rank`` (at the first update after InitWeightSync), receives the buckets, loads them with
``model.load_weights`` and writes its receipt to a file the request names (a loader returns nothing to the
caller). The call runs inside SGLang's weight-update session: ``begin_weight_update`` / ``end_weight_update``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import itertools
import json
import logging
import os
import queue
import random
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from relayrl.rollout.engine import EngineCompletion, FinishReason, InferenceEngine
from relayrl.rollout.external import (
    EngineGroup,
    EngineReceiver,
    GroupArgs,
    RoutingLayout,
    adapter_module_count,
    check_weights,
    collect_receipts,
    hf_model_info,
    import_engine,
    refuse_unmatched_logprobs,
    reject_reserved_options,
)
from relayrl.runtime.files import atomic_write
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.stats import ReceiveStats
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

LOADER = "relayrl.rollout.sglang.receive_in_scheduler"
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_RESERVED = (
    "model_path",
    "custom_weight_loader",
    "random_seed",
    "max_running_requests",
    "skip_tokenizer_init",
    "weight_version",
)
POLL_S = 0.05  # how often a streaming generate call checks should_abort while no chunk arrives
SEED_BOUND = 1 << 31  # sampling seeds drawn for seedless requests are in [0, SEED_BOUND)

# The receiver of each scheduler (by local rank) in this process (a real scheduler process holds exactly one).
_RECEIVERS: dict[int, EngineReceiver] = {}


def scheduler_rank() -> int:
    """This scheduler's rank within the engine: ``pp_rank * tp_size + tp_rank`` (unique across TP x PP)."""
    from sglang.srt.distributed.parallel_state import (
        get_pipeline_model_parallel_rank,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp_size = get_tensor_model_parallel_world_size()
    return get_pipeline_model_parallel_rank() * tp_size + get_tensor_model_parallel_rank()


def receive_in_scheduler(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: run one relayrl update inside this scheduler (see the module docstring).

    ``named_tensors`` is ``[(request JSON, empty tensor on the scheduler's device)]``; the request holds
    ``group`` (GroupArgs fields), ``manifest`` (its JSON), ``result`` (the receipt file prefix) and, for an
    adapter manifest, ``adapter``: the file where scheduler 0 writes the received tensors (the model is untouched).
    """
    ((request_json, anchor),) = named_tensors
    request = json.loads(request_json)
    rank = scheduler_rank()
    receiver = _RECEIVERS.get(rank)
    if receiver is None:
        receiver = _RECEIVERS[rank] = EngineReceiver(anchor.device, rank)
    group = GroupArgs(**request["group"]) if request["group"] is not None else None
    manifest = WeightManifest.from_json(request["manifest"])
    target = _Collector() if request.get("adapter") else model
    receipt = receiver.receive(manifest, target, tp_size=request["tp_size"], group=group)
    if request.get("adapter") and rank == 0 and "error" not in receipt:
        from safetensors.torch import save_file

        save_file(target.tensors, request["adapter"])
    atomic_write(Path(f"{request['result']}.rank{rank}.json"), json.dumps(receipt))


class _Collector:
    """A stand-in model that keeps what ``load_weights`` gets (an adapter's tensors) and has no parameters."""

    packed_modules_mapping = None

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors.update((name, t.detach().to("cpu").clone().contiguous()) for name, t in weights)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


class SGLangEngine(InferenceEngine):
    """SGLang backend (pause mode, and rows kept in flight through an update). ``options`` go to ``sglang.Engine``
    as they are (``tp_size``, ``mem_fraction_static``, ``context_length``, ``enable_deterministic_inference``,
    ...), except those this adapter sets. ``seed`` per request takes effect only with
    ``enable_deterministic_inference: true``. Speculative decoding is refused: SGLang runs a custom weight loader
    once per model runner (target and draft), so relayrl's receive would run twice per update and wait for a
    broadcast that never comes."""

    name = "sglang"
    receives_weights_itself: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_batch_size: int = 256,
        seed: int = 0,
        routing_replay: bool = False,
        options_key: str = "rollout.engine_options",
        **options: Any,
    ) -> None:
        """``routing_replay`` (``algorithm.routing_replay``): ``Engine(enable_return_routed_experts=True)`` and
        ``return_routed_experts`` on every request (SGLang >= 0.5.23); each completion's
        ``meta_info["routed_experts"]`` as its ``routed_experts``. ``options_key``: the config key ``options`` came
        from, named by the errors about them (a judge's ``scorers.<name>.engine_options``)."""
        reject_reserved_options(options, _RESERVED, "sglang", options_key)
        if options.get("speculative_algorithm") is not None:
            raise ValueError(
                f"{options_key}.speculative_algorithm: speculative decoding is not supported by the sglang "
                "engine (SGLang would run relayrl's weight receive on the draft runner too); leave it unset"
            )
        sglang = import_engine("sglang")
        info = hf_model_info(model_path, dtype)
        self.tokenizer = info.tokenizer
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = info.vocab_size
        self._specs = info.specs
        self._routing = info.routing_layout("sglang") if routing_replay else None
        if self._routing is not None:
            self.routed_bytes_per_token = self._routing.bytes_per_token
            options = {**options, "enable_return_routed_experts": True}
        self.engine = sglang.Engine(
            model_path=model_path,
            dtype=dtype,
            random_seed=seed,
            max_running_requests=max_batch_size,
            custom_weight_loader=[LOADER],
            weight_version="0",  # the label of the tokens sampled before the first update (version 0)
            **options,
        )
        self.max_model_len = self.engine.tokenizer_manager.context_len
        self._tp_size = int(options.get("tp_size", 1))
        self.weight_sync_ranks = self._tp_size * int(options.get("pp_size", 1))
        self._receipts = tempfile.mkdtemp(prefix="relayrl-sglang-")
        self._updates = itertools.count()
        self._group: GroupArgs | None = None
        self._checksum = ""
        self._seeds = random.Random(seed)
        self._runner = _LoopRunner(self.engine.loop)
        self._version = 0  # the policy version of the weights loaded: the label of the tokens sampled now
        self._paused = False
        self._adapters: list[str] = []  # adapter names loaded, oldest first (the last one serves)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """See ``InferenceEngine.generate``; thread-safe: every call streams ``Engine.async_generate`` on SGLang's
        event loop (``_LoopRunner``), so the items of concurrent calls reach its scheduler together and share
        batches. Aborted samples carry the tokens generated so far. InvalidArgument for ``min_tokens > 0``
        (SGLang's logprobs are then not the trainer's, see ``refuse_unmatched_logprobs``)."""
        refuse_unmatched_logprobs(params, "sglang", top_p=False)
        batch = uuid.uuid4().hex[:12]
        items = [(p, s) for p in range(len(prompts)) for s in range(params.n)]
        rids = [f"relayrl-{batch}-{p}-{s}" for p, s in items]
        pending = dict(zip(rids, items, strict=True))
        version = self._version
        request = {
            "input_ids": [list(prompts[p]) for p, _ in items],
            "sampling_params": [self._sampling_params(params, self._sampling_seed(params, s)) for _, s in items],
            "return_logprob": True,
            "stream": True,
            "rid": rids,
            "cache_salt": [_salt(version)] * len(items),
        }
        if self._adapters:
            request["lora_path"] = [self._adapters[-1]] * len(items)
        if self._routing is not None:
            request["return_routed_experts"] = True
        with self._runner.streaming():
            chunks = self._runner.stream(self.engine.async_generate, request)
            aborting = False
            try:
                for chunk in chunks:
                    if chunk is not None:
                        meta = chunk["meta_info"]
                        if meta["finish_reason"] is not None and meta["id"] in pending:
                            p, s = pending.pop(meta["id"])
                            yield _completion(p, s, chunk, version, self._routing)
                    if pending and not aborting and should_abort is not None and should_abort():
                        aborting = True
                        self._runner.abort(self.engine.tokenizer_manager, list(pending))
            finally:
                if pending:  # the consumer stopped early: abort, and drain so nothing keeps running
                    self._runner.abort(self.engine.tokenizer_manager, list(pending))
                    for _ in chunks:
                        pass

    def _sampling_seed(self, params: SamplingParams, sample_index: int) -> int:
        """``seed + sample_index`` for a seeded request; otherwise a fresh seed from the engine's generator."""
        if params.seed is not None:
            return params.seed + sample_index
        return self._seeds.randrange(SEED_BOUND)

    @staticmethod
    def _sampling_params(params: SamplingParams, sampling_seed: int) -> dict[str, Any]:
        """SGLang's sampling_params for one sample; penalties, top-k and min-p set to neutral explicitly so that
        no server-side default (``preferred_sampling_params``) can change the distribution."""
        return {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            # SGLang matches stop strings in the decoded tail of output_ids, which keep the token that completed one;
            # no_stop_trim keeps the string in the text (vLLM's include_stop_str_in_output)
            "stop": list(params.stop) or None,
            "no_stop_trim": params.include_stop_str_in_output,
            "sampling_seed": sampling_seed,
        }

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The Hugging Face specs the trainer sends (not SGLang's fused internal layout)."""
        return list(self._specs)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Not available: SGLang's Engine exposes no parameter iterator (``get_weights_by_name`` is a truncated,
        per-model test hook); relayrl verifies SGLang's weights with ``loaded_checksum`` instead."""
        raise NotImplementedError("the sglang engine cannot list its weights; see docs/engines.md")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes against the checkpoint's, then ``update_weights_from_tensor`` (SGLang's own
        loader, through its IPC channel: meant for small updates; weight sync uses ``receive_update``)."""
        pairs = [(name, t.detach().to("cpu")) for name, t in weights]
        check_weights(self._specs, pairs)
        with self._runner.exclusive():
            self._in_session(lambda: self.engine.update_weights_from_tensor(named_tensors=pairs, flush_cache=True))

    # -- weight sync handed over by the rollout worker (see docs/engines.md) -------------------------------
    def init_weight_sync(self, args: GroupArgs) -> EngineGroup:
        """Remember ``args``: the schedulers join (rank ``rank_offset + scheduler_rank()``) at the next update."""
        self._group = args
        return EngineGroup(args.group_name, self._forget_group)

    def _forget_group(self) -> None:
        self._group = None

    def receive_update(self, manifest: WeightManifest) -> ReceiveStats:
        """Every scheduler receives (or reads) ``manifest``'s tensors and loads them. With no request in flight the
        radix cache is flushed and later tokens carry ``manifest.version``; between ``pause_in_flight`` and
        ``resume_in_flight`` the frozen requests make a flush fail (``Scheduler.flush_cache`` refuses while
        requests run), so the update runs with ``flush_cache=False`` and ``resume_in_flight`` salts new requests."""
        self._checksum = ""  # a failed update leaves no checksum behind
        prefix = os.path.join(self._receipts, f"update-{next(self._updates)}")
        request = {
            "group": self._group.to_dict() if self._group is not None else None,
            "manifest": manifest.to_json(),
            "tp_size": self._tp_size,
            "result": prefix,
            "adapter": f"{prefix}.adapter.safetensors" if manifest.kind == "adapter" else "",
        }
        carrier = [(json.dumps(request), torch.empty(0))]
        paused = self._paused
        with self._runner.halted() if paused else self._runner.exclusive():
            self._in_session(
                lambda: self.engine.update_weights_from_tensor(
                    named_tensors=carrier, load_format=LOADER, flush_cache=not paused and not request["adapter"]
                )
            )
        results = []
        for rank in range(self.weight_sync_ranks):
            path = Path(f"{prefix}.rank{rank}.json")
            if not path.exists():
                raise RuntimeError(f"sglang engine: scheduler {rank} reported no result for version {manifest.version}")
            results.append(json.loads(path.read_text(encoding="utf-8")))
            path.unlink()
        stats, self._checksum = collect_receipts(results)
        if request["adapter"]:  # the adapter's tensors, kept aside by scheduler 0, loaded as policy-v<version>
            from safetensors.torch import load_file

            tensors = load_file(request["adapter"])
            os.unlink(request["adapter"])
            self.load_adapter(f"policy-v{manifest.version}", manifest.lora, tensors)
        if not paused:
            with self._runner.exclusive():
                self._set_version(manifest.version)
        return stats

    # -- LoRA adapters (model.lora; see docs/engines.md) -------------------------------------------------------
    supports_lora: ClassVar[bool] = True

    def load_adapter(self, name: str, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> int:
        """``Engine.load_lora_adapter_from_tensors(name, tensors, config_dict)`` (SGLang's tensor path; PEFT's
        config), under a new name per version (SGLang refuses a name already loaded; its radix cache is keyed by
        the adapter's load id, so no version reuses another's KV); versions older than the previous one are
        unloaded. The module count is checked before loading against the checkpoint's unfused Linears (SGLang
        reports none). ValueError, the previous adapter serving on, when the names or the load fail."""
        sent = adapter_module_count(tensors, self._specs, "sglang")
        config = spec.peft_config()
        staged = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        with self._runner.halted() if self._paused else self._runner.exclusive():
            result = self.engine.load_lora_adapter_from_tensors(lora_name=name, tensors=staged, config_dict=config)
            if not result.success:
                hint = " (rollout.engine_options.enable_lora)" if "not enabled" in str(result.error_message) else ""
                raise ValueError(f"adapter {name}: sglang refused it: {result.error_message}{hint}")
            self._adapters.append(name)
            while len(self._adapters) > 2:
                self.engine.unload_lora_adapter(self._adapters.pop(0))
        return sent

    # -- in-flight weight updates (rollout.partial; see docs/engines.md) -------------------------------------
    supports_in_flight_update: ClassVar[bool] = True

    def pause_in_flight(self) -> None:
        """SGLang's ``pause_generation(mode="in_place")`` (a ``TokenizerManager`` coroutine: the offline Engine has
        no method for it), run on the engine's loop while it is halted: the scheduler stops, every request stays in
        the running batch with its KV; new requests wait in the tokenizer manager. Open calls stay open."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        manager = self.engine.tokenizer_manager
        with self._runner.halted():
            self.engine.loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput(mode="in_place")))
        self._paused = True

    def resume_in_flight(self, version: int) -> None:
        """Label later tokens ``version`` (``update_weight_version(abort_all_requests=False)``: its default aborts
        every request; SGLang then reports ``meta_info["weight_versions"]`` spans), salt new requests' radix keys
        with it, and ``continue_generation``."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        with self._runner.halted():
            self._set_version(version)
            self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput())
            )
        self._paused = False

    def _set_version(self, version: int) -> None:
        """``update_weight_version`` on the halted loop, keeping every request."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        obj = UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        self.engine.loop.run_until_complete(self.engine.tokenizer_manager.update_weight_version(obj))
        self._version = version

    def _in_session(self, update: Callable[[], tuple[bool, str]]) -> None:
        """Run one ``update_weights_*`` call inside ``begin_weight_update`` / ``end_weight_update``."""
        ok, message = self.engine.begin_weight_update()
        if not ok:
            raise RuntimeError(f"sglang begin_weight_update: {message}")
        try:
            ok, message = update()
        finally:
            self.engine.end_weight_update()
        if not ok:
            raise RuntimeError(f"sglang weight update: {message}")

    def loaded_checksum(self) -> str:
        """``weights_checksum`` of the tensors the last ``receive_update`` loaded; "" before the first."""
        return self._checksum

    def close(self) -> None:
        self.engine.shutdown()
        shutil.rmtree(self._receipts, ignore_errors=True)


class _LoopRunner:
    """Runs SGLang's event loop (``Engine.loop``, where its tokenizer manager lives) in one adapter thread while
    any ``generate`` call streams, so calls from several threads submit to SGLang concurrently (it batches them);
    when the last call ends the loop is stopped again, so that the Engine's synchronous methods
    (``loop.run_until_complete``: the weight updates) can run it: ``exclusive()`` waits for no call to stream
    and keeps new ones out meanwhile."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._cond = threading.Condition()
        self._streams = 0
        self._exclusive = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._streams += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self.loop.run_forever, name="relayrl-sglang-loop", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._cond:
                self._streams -= 1
                if not self._streams and self._thread is not None:
                    self.loop.call_soon_threadsafe(self.loop.stop)
                    self._thread.join()
                    self._thread = None
                self._cond.notify_all()

    @contextlib.contextmanager
    def halted(self) -> Iterator[None]:
        """The loop stopped (its thread joined) even while calls stream, so that the caller can run it
        (``run_until_complete``: SGLang's synchronous methods, tokenizer-manager coroutines); new calls wait; the
        loop thread is started again afterwards if calls are still open."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            if self._thread is not None:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
                self._thread = None
        try:
            yield
        finally:
            with self._cond:
                if self._streams:
                    self._thread = threading.Thread(
                        target=self.loop.run_forever, name="relayrl-sglang-loop", daemon=True
                    )
                    self._thread.start()
                self._exclusive = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._streams or self._exclusive:
                self._cond.wait()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def stream(self, async_generate: Callable[..., Any], request: dict[str, Any]) -> Iterator[dict | None]:
        """The chunks of ``await async_generate(**request)`` (run on the loop), with None every POLL_S while
        none arrives (so the caller can check for an abort); raises what the stream raised."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for chunk in await async_generate(**request):
                    chunks.put(chunk)
            except BaseException as exc:  # handed to the calling thread
                chunks.put(exc)
            finally:
                chunks.put(self._END)

        asyncio.run_coroutine_threadsafe(pump(), self.loop)
        while True:
            try:
                item = chunks.get(timeout=POLL_S)
            except queue.Empty:
                yield None
                continue
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise RuntimeError(f"sglang engine: {item}") from item
            yield item

    def abort(self, tokenizer_manager: Any, rids: list[str]) -> None:
        """``tokenizer_manager.abort_request(rid=)`` for each, on the loop (the manager is not thread-safe)."""
        for rid in rids:
            self.loop.call_soon_threadsafe(functools.partial(tokenizer_manager.abort_request, rid=rid))


def _salt(version: int) -> str:
    """The ``cache_salt`` of requests added under policy ``version`` (SGLang's ``RadixKey`` namespace): requests of
    one version share prefixes (a later turn reuses its conversation's KV), never another version's."""
    return f"relayrl-v{version}"


def _completion(
    prompt_index: int, sample_index: int, chunk: dict[str, Any], version: int, routing: RoutingLayout | None = None
) -> EngineCompletion:
    """An item's final chunk as an EngineCompletion; ``token_versions`` from ``meta_info["weight_versions"]`` when
    any token was sampled by another version than ``version``; ``routed_experts`` from
    ``meta_info["routed_experts"]`` when ``routing`` is given: base64 of int32 [tokens, layers, top_k], every token
    of the sequence but the last (``sglang/srt/managers/tokenizer_manager.py``, ``io_struct.py``
    ``routed_experts_start_len``; ``extract_routed_experts_from_meta_info`` in
    ``sglang/srt/state_capturer/routed_experts.py`` decodes it so)."""
    meta = chunk["meta_info"]
    token_ids = list(chunk["output_ids"])
    logprobs = [float(logprob) for logprob, _, _ in meta["output_token_logprobs"]]
    reason = FINISH_REASONS.get(meta["finish_reason"]["type"])
    if reason is None:
        log.warning("sglang engine: sample finished with %r; reported as aborted", meta["finish_reason"])
        reason = "abort"
    if len(logprobs) != len(token_ids):
        if reason != "abort":
            raise RuntimeError(f"sglang returned {len(token_ids)} tokens but {len(logprobs)} logprobs")
        kept = min(len(logprobs), len(token_ids))  # an abort may cut the two at different points
        token_ids, logprobs = token_ids[:kept], logprobs[:kept]
    spans = meta.get("weight_versions") or ()
    versions = [int(span["version"]) for span in spans for _ in range(span["start"], span["end"])][: len(token_ids)]
    mixed = len(versions) == len(token_ids) and any(v != version for v in versions)
    encoded = meta.get("routed_experts") if routing is not None else None
    routed = None if encoded is None else routing.rows(np.frombuffer(base64.b64decode(encoded), dtype=np.int32))
    return EngineCompletion(
        prompt_index, sample_index, token_ids, logprobs, reason, versions if mixed else None, routed
    )
