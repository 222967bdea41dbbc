"""The ``vllm`` engine: vLLM's offline ``LLM``, driven step by step, with relayrl's weight sync inside its workers.

Generation: every (prompt, sample) becomes one request (``n=1``, ``seed + sample_index``: what vLLM's own
``ParentRequest`` fan-out does for ``n > 1``), added to ``LLM.llm_engine`` by one stepping thread that steps
the engine while any request is unfinished, whichever ``generate`` call it came from: concurrent calls share
engine steps. Each sample is yielded as soon as it is done; ``should_abort`` is checked while waiting (then
the call's unfinished requests are aborted with ``abort_request``). Logprobs: ``logprobs=0`` (the sampled token only)
under ``logprobs_mode="processed_logprobs"``: log softmax(logits / T), relayrl's convention, exactly when
``top_p == 1`` and ``min_tokens == 0``; vLLM renormalises over the top-p nucleus and after its min-tokens mask,
so those settings are refused with INVALID_ARGUMENT (see ``docs/engines.md``), as is a temperature above
vLLM's bound of 2.

Weights: ``RelayRLWorkerExtension`` is mixed into every vLLM worker (``worker_extension_cls``) and reached by
``LLM.collective_rpc``; each worker joins relayrl's group as ``rank_offset + worker rank`` and loads the
buckets with ``model.load_weights`` (Hugging Face names; vLLM shards and fuses them itself).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from relayrl.errors import InvalidArgument
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
    tensors_from_wire,
    tensors_to_wire,
)
from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.filesystem import read_weights, remove_tree
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.receiver import receive_weights
from relayrl.weightsync.stats import ReceiveStats
from relayrl.wire.lora import LoraAdapterSpec
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

EXTENSION = "relayrl.rollout.vllm.RelayRLWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_RESERVED = ("logprobs_mode", "worker_extension_cls", "model", "max_num_seqs")
POLL_S = 0.05  # how often a waiting generate call checks should_abort
MAX_TEMPERATURE = 2.0  # vllm/sampling_params.py: SamplingParams._verify_args refuses temperatures above


class RelayRLWorkerExtension:
    """Mixed into each vLLM worker class (``LLM(worker_extension_cls=EXTENSION)``); every method is called on
    all workers at once through ``LLM.collective_rpc``. Uses the worker's ``rank``, ``device`` and
    ``model_runner``; names are prefixed so they cannot clash with the worker's own attributes."""

    def relayrl_get_receiver(self) -> EngineReceiver:
        """This worker's receiver (group membership, staging buffers), created on first use."""
        if getattr(self, "relayrl_receiver", None) is None:
            self.relayrl_receiver = EngineReceiver(self.device, self.rank)
        return self.relayrl_receiver

    def relayrl_init_weight_sync(self, group_args: dict[str, Any]) -> None:
        """Join relayrl's group as ``rank_offset + self.rank`` (leaving any previous one)."""
        self.relayrl_get_receiver().join(GroupArgs(**group_args))

    def relayrl_close_weight_sync(self) -> None:
        self.relayrl_get_receiver().close()

    def relayrl_receive(self, manifest_json: str, tp_size: int) -> dict[str, Any]:
        """Receive one update into the model; the receipt of ``EngineReceiver.receive`` (plain data)."""
        model = self.model_runner.get_model()
        return self.relayrl_get_receiver().receive(WeightManifest.from_json(manifest_json), model, tp_size=tp_size)

    def relayrl_load_weights(self, wire: list[list[Any]]) -> None:
        """Load ``tensors_to_wire`` data (tensors do not survive vLLM's msgpack RPC; plain bytes do)."""
        model = self.model_runner.get_model()
        model.load_weights(weights=[(name, t.to(self.device)) for name, t in tensors_from_wire(wire)])

    def relayrl_receive_adapter(self, manifest_json: str, path: str) -> dict[str, Any]:
        """Receive (or read) an adapter manifest's tensors, kept aside (not loaded into the model); worker 0 writes
        them to ``path`` as a PEFT directory for ``add_lora``. A receipt as ``EngineReceiver.receive``'s."""
        receiver = self.relayrl_get_receiver()
        manifest = WeightManifest.from_json(manifest_json)
        tensors: dict[str, torch.Tensor] = {}

        def keep(views: list[tuple[str, torch.Tensor]]) -> None:
            tensors.update((name, view.detach().to("cpu").clone()) for name, view in views)

        try:
            if manifest.transport == "filesystem":
                stats = read_weights(manifest.path, manifest, keep)
            elif receiver.group is None:
                raise WeightSyncError(f"engine rank {self.rank} has joined no weight group")
            else:
                stats = receive_weights(
                    receiver.group, manifest, keep, device=receiver.device, buffers=receiver.buffers
                )
            if self.rank == 0:
                write_peft_dir(path, manifest.lora, tensors)
        except Exception as exc:
            return {"error": f"engine rank {self.rank}: {exc}", "error_type": type(exc).__name__}
        return {
            "checksum": "",
            "seconds": stats.seconds,
            "nbytes": stats.nbytes,
            "buckets": stats.buckets,
            "peak_extra_bytes": stats.peak_extra_bytes,
        }

    def relayrl_lora_modules(self, lora_id: int) -> int:
        """How many modules of this worker's model adapter ``lora_id`` applies to: its layers that are among the
        LoRA manager's modules, each piece of a packed layer (``qkv_proj`` holds q, k, v) counted
        (vllm/lora/model_manager.py: ``modules``, ``get_adapter``; vllm/lora/lora_weights.py)."""
        manager = self.model_runner.lora_manager._adapter_manager
        lora = manager.get_adapter(lora_id)
        if lora is None:
            return 0
        count = 0
        for module, layer in lora.loras.items():
            if module in manager.modules:
                pieces = layer.lora_a
                count += sum(piece is not None for piece in pieces) if isinstance(pieces, list) else 1
        return count

    def relayrl_named_weights(self) -> list[list[Any]]:
        """This worker's parameters under vLLM's own names (fused, this rank's shard), as ``tensors_to_wire``."""
        return tensors_to_wire(self.model_runner.get_model().named_parameters())


class VLLMEngine(InferenceEngine):
    """vLLM backend (pause mode, and rows kept in flight through an update). ``options`` go to ``vllm.LLM`` as
    they are (``tensor_parallel_size``, ``gpu_memory_utilization``, ``enforce_eager``, ``max_model_len``, ...),
    except those this adapter sets."""

    name = "vllm"
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
        """``routing_replay`` (``algorithm.routing_replay``): ``LLM(enable_return_routed_experts=True)`` (vLLM
        >= 0.34) and each completion's ``CompletionOutput.routed_experts`` as its ``routed_experts``.
        ``options_key``: the config key ``options`` came from, named by the errors about them (a judge's
        ``scorers.<name>.engine_options``)."""
        reject_reserved_options(options, _RESERVED, "vllm", options_key)
        vllm = import_engine("vllm")
        from vllm.sampling_params import RequestOutputKind

        self._vllm = vllm
        self._final_only = RequestOutputKind.FINAL_ONLY
        info = hf_model_info(model_path, dtype)
        self.tokenizer = info.tokenizer
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = info.vocab_size
        self._specs = info.specs
        self._routing = info.routing_layout("vllm") if routing_replay else None
        if self._routing is not None:
            self.routed_bytes_per_token = self._routing.bytes_per_token
            options = {**options, "enable_return_routed_experts": True}
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_batch_size,
            logprobs_mode=LOGPROBS_MODE,
            worker_extension_cls=EXTENSION,
            **options,
        )
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.weight_sync_ranks = self.llm.get_world_size(include_dp=False)
        self._tp_size = int(options.get("tensor_parallel_size", 1))
        self._calls = itertools.count()
        self._stepper = _Stepper(self.llm.llm_engine)
        self._checksum = ""
        self._version = 0  # the policy version of the weights loaded: the label of the tokens sampled now
        self._paused = False
        self.llm.update_weight_version("0")
        self._lora_ids = itertools.count(1)
        self._adapters: list[Any] = []  # LoRARequests of the versions loaded, oldest first (the last one serves)
        self._staging = ""  # where adapters are staged as PEFT directories (shared memory when there is one)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """See ``InferenceEngine.generate``; thread-safe: the requests of concurrent calls join the same engine
        steps (``_Stepper``). Aborted samples carry no tokens (vLLM returns only final outputs). InvalidArgument
        for ``top_p < 1``, ``min_tokens > 0`` (logprobs not the trainer's) and temperature > 2."""
        refuse_unmatched_logprobs(params, "vllm", top_p=True)
        if params.temperature > MAX_TEMPERATURE:
            raise InvalidArgument("params.temperature", f"the vllm engine takes at most {MAX_TEMPERATURE}")
        call = next(self._calls)
        pending: dict[str, tuple[int, int]] = {}
        requests = []
        version = self._version
        for p, prompt in enumerate(prompts):
            for s in range(params.n):
                request_id = f"relayrl-{call}-{p}-{s}"
                prompt_ids = self._vllm.TokensPrompt(prompt_token_ids=list(prompt), cache_salt=_salt(version))
                lora = self._adapters[-1] if self._adapters else None
                requests.append((request_id, prompt_ids, self._sampling_params(params, s), lora))
                pending[request_id] = (p, s)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stepper.submit(requests, outbox)
        try:
            while pending:
                if should_abort is not None and should_abort():
                    yield from _finished(
                        outbox, pending, version, self._routing, block=False
                    )  # what is done already is not lost
                    aborted, pending = pending, {}
                    self._stepper.abort(list(aborted))
                    yield from (EngineCompletion(p, s, [], [], "abort") for p, s in aborted.values())
                    return
                yield from _finished(outbox, pending, version, self._routing, block=True)
        finally:
            if pending:  # the consumer stopped early (or failed): leave nothing running in the engine
                self._stepper.abort(list(pending))

    def _sampling_params(self, params: SamplingParams, sample_index: int) -> Any:
        """vLLM's SamplingParams for one sample of ``params``."""
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            seed=None if params.seed is None else params.seed + sample_index,
            logprobs=0,
            # vLLM matches stop strings in its detokenized text (it refuses stop with detokenize off); the token ids
            # it returns keep every sampled token, the one that completed the string included
            stop=list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
            detokenize=bool(params.stop),
            output_kind=self._final_only,
        )

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The Hugging Face specs the trainer sends (not vLLM's fused internal layout)."""
        return list(self._specs)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """CPU copies of worker 0's parameters, under vLLM's names (fused ``qkv_proj``/``gate_up_proj``, worker
        0's tensor-parallel shard). Not live: writing to them changes nothing; for inspection only."""
        yield from tensors_from_wire(self.llm.collective_rpc("relayrl_named_weights")[0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes against the checkpoint's, then load on every worker (through the RPC channel:
        meant for small updates; weight sync uses ``receive_update``) and drop the now stale prefix cache."""
        pairs = [(name, t.detach().to("cpu")) for name, t in weights]
        check_weights(self._specs, pairs)
        self.llm.collective_rpc("relayrl_load_weights", args=(tensors_to_wire(pairs),))
        self.llm.reset_prefix_cache()

    # -- weight sync handed over by the rollout worker (see docs/engines.md) -------------------------------
    def init_weight_sync(self, args: GroupArgs) -> EngineGroup:
        """Every worker joins ``args``'s group as ``rank_offset + its rank``."""
        self.llm.collective_rpc("relayrl_init_weight_sync", args=(args.to_dict(),))
        return EngineGroup(args.group_name, lambda: self.llm.collective_rpc("relayrl_close_weight_sync"))

    def receive_update(self, manifest: WeightManifest) -> ReceiveStats:
        """Every worker receives (or reads) ``manifest``'s tensors and loads them. With no request in flight the
        prefix cache is reset and later tokens carry ``manifest.version``; between ``pause_in_flight`` and
        ``resume_in_flight`` the frozen requests hold KV blocks, so vLLM cannot reset the cache (``BlockPool.
        reset_prefix_cache`` returns False): ``resume_in_flight`` changes the requests' ``cache_salt`` instead."""
        self._checksum = ""  # a failed update leaves no checksum behind
        if manifest.kind == "adapter":
            return self._receive_adapter(manifest)
        results = self.llm.collective_rpc("relayrl_receive", args=(manifest.to_json(), self._tp_size))
        stats, self._checksum = collect_receipts(results)
        if not self._paused:
            self.llm.reset_prefix_cache()
            self._set_version(manifest.version)
        return stats

    # -- LoRA adapters (model.lora; see docs/engines.md) -------------------------------------------------------
    supports_lora: ClassVar[bool] = True

    def load_adapter(self, name: str, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> int:
        """vLLM has no public way to load an adapter from tensors: ``tensors`` are written as a PEFT directory
        (``adapter_model.safetensors``, ``adapter_config.json``) under shared memory and added with
        ``LLMEngine.add_lora(LoRARequest(name, new id, path))``. Every version gets its own name, id and path: vLLM
        keys its prefix cache by adapter name and path, keeps an id it has without ``load_inplace`` (which, left
        on a request, reloads at every step), and folds alpha / r into ``lora_B`` in place (files are read afresh,
        so nothing is scaled twice). Requests in flight keep the version they started with; versions older than
        the previous one are removed. ValueError (the previous adapter serving on) for names that are not the
        model's unfused Linears, or when vLLM applies the adapter to fewer modules than were sent."""
        sent = adapter_module_count(tensors, self._specs, "vllm")
        lora_id, path = self._new_path(name)
        write_peft_dir(path, spec, tensors)
        return self._add_adapter(name, lora_id, path, sent)

    def _new_path(self, name: str) -> tuple[int, str]:
        """A new adapter id, and a directory for it under shared memory (when there is one)."""
        if not self._staging:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._staging = tempfile.mkdtemp(prefix="relayrl-lora-", dir=shm)
        lora_id = next(self._lora_ids)
        return lora_id, os.path.join(self._staging, f"{name}-{lora_id}")

    def _add_adapter(self, name: str, lora_id: int, path: str, sent: int) -> int:
        """``add_lora`` the PEFT directory at ``path``; check that every worker applies it to ``sent`` modules."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        added = False
        try:
            if not (added := self.llm.llm_engine.add_lora(request)):
                raise ValueError(f"adapter {name}: vLLM did not add it")
            applied = self.llm.collective_rpc("relayrl_lora_modules", args=(lora_id,))
            if any(count != sent for count in applied):
                raise ValueError(f"adapter {name}: vLLM adapted {min(applied)} modules, {sent} were sent")
        except Exception as exc:
            self._drop(request, added=added)
            if "LoRA is not enabled" in str(exc):
                raise ValueError("rollout.engine_options.enable_lora: start the vllm engine with it true") from exc
            raise
        self._adapters.append(request)
        while len(self._adapters) > 2:
            self._drop(self._adapters.pop(0))
        return sent

    def _drop(self, request: Any, *, added: bool = True) -> None:
        """``remove_lora`` a version the engine added, and delete its files. A failure is logged at WARNING (not
        raised: the newer adapter serves on): the version then keeps one of the engine's LoRA slots, and its
        files their memory, until the worker restarts."""
        if added:
            try:
                removed = self.llm.llm_engine.remove_lora(request.lora_int_id)
            except Exception as exc:
                removed = f"{type(exc).__name__}: {exc}"
            if removed is not True:
                log.warning(
                    "vllm engine: remove_lora(%d) of %s failed (%s): it keeps an engine LoRA slot",
                    request.lora_int_id, request.lora_name, "it was not loaded" if removed is False else removed,
                )  # fmt: skip
        remove_tree(request.lora_path, f"the files of adapter {request.lora_name}")

    def _receive_adapter(self, manifest: WeightManifest) -> ReceiveStats:
        """An adapter manifest (``kind == "adapter"``): the workers receive its tensors, worker 0 writes the PEFT
        directory, and it is added as version ``policy-v<version>`` (``load_adapter``'s checks)."""
        name = f"policy-v{manifest.version}"
        sent = adapter_module_count(dict.fromkeys(t.name for t in manifest.tensors), self._specs, "vllm")
        lora_id, path = self._new_path(name)
        results = self.llm.collective_rpc("relayrl_receive_adapter", args=(manifest.to_json(), path))
        stats, _ = collect_receipts(results)
        self._add_adapter(name, lora_id, path, sent)
        return stats

    # -- in-flight weight updates (rollout.partial; see docs/engines.md) -------------------------------------
    supports_in_flight_update: ClassVar[bool] = True

    def pause_in_flight(self) -> None:
        """vLLM's ``pause_generation(mode="keep", clear_cache=False)`` (``EngineCoreProc.pause_generation``, what
        ``AsyncLLM.pause_generation`` calls): every request stays where it is with its KV blocks; returns once the
        engine core is idle. Open ``generate`` calls stay open."""
        self.llm.llm_engine.engine_core.call_utility("pause_generation", "keep", False)
        self._paused = True

    def resume_in_flight(self, version: int) -> None:
        """Label later tokens ``version`` (``LLM.update_weight_version``: vLLM reports each request's
        ``weight_versions`` spans), salt new requests' prefix-cache keys with it (a new request never reuses KV
        of the old weights; the frozen ones keep theirs) and ``resume_scheduler`` (``AsyncLLM.resume_generation``)."""
        self._set_version(version)
        self.llm.llm_engine.engine_core.call_utility("resume_scheduler")
        self._paused = False

    def _set_version(self, version: int) -> None:
        self.llm.update_weight_version(str(version))
        self._version = version

    def loaded_checksum(self) -> str:
        """``weights_checksum`` of the tensors the last ``receive_update`` loaded; "" before the first."""
        return self._checksum

    def close(self) -> None:
        if self._paused:  # the stepper waits for outputs that come only after a resume
            self.llm.llm_engine.engine_core.call_utility("resume_scheduler")
        self._stepper.close()
        self.llm.collective_rpc("relayrl_close_weight_sync")
        self.llm.llm_engine.engine_core.shutdown()
        if self._staging:
            remove_tree(self._staging, "the adapter staging directory")


class _Stepper:
    """The one thread that drives ``LLM.llm_engine`` (not thread-safe): it adds the requests ``submit`` queues,
    carries out ``abort``, and steps while any request is unfinished, handing each finished output to the queue
    of the call that added it. Requests of concurrent calls thus share engine steps (vLLM's continuous batching:
    they join the running batch between steps). A failing step fails every call that has a request in it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, queue.SimpleQueue] = {}  # request id -> its call's outbox (stepper thread only)
        self._thread = threading.Thread(target=self._run, name="relayrl-vllm-stepper", daemon=True)
        self._thread.start()

    def submit(self, requests: list[tuple[str, Any, Any, Any]], outbox: queue.SimpleQueue) -> None:
        """Queue ``requests`` (request id, prompt, vLLM SamplingParams, LoRARequest or None); each finished output,
        or the error that stopped it, is put on ``outbox`` as (request id, output or exception)."""
        self._inbox.put(("add", requests, outbox))

    def abort(self, request_ids: list[str]) -> None:
        """Abort those of ``request_ids`` still in the engine; returns once done."""
        done = threading.Event()
        self._inbox.put(("abort", request_ids, done))
        done.wait()

    def close(self) -> None:
        self._inbox.put(("close", None, None))
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            message = self._inbox.get()  # blocks only while nothing is running
            while True:
                if not self._apply(*message):
                    return
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
            while self._routes:
                self._step()
                try:
                    while True:
                        if not self._apply(*self._inbox.get_nowait()):
                            return
                except queue.Empty:
                    pass

    def _apply(self, kind: str, payload: Any, reply: Any) -> bool:
        """Carry out one queued message; False for "close"."""
        if kind == "close":
            for request_id, outbox in self._routes.items():
                outbox.put((request_id, RuntimeError("the vllm engine was closed")))
            return False
        if kind == "abort":
            live = [request_id for request_id in payload if self._routes.pop(request_id, None) is not None]
            try:
                if live:
                    self.engine.abort_request(live)
            finally:
                reply.set()
            return True
        for request_id, prompt, params, lora in payload:
            try:
                self.engine.add_request(request_id, prompt, params, lora_request=lora)
                self._routes[request_id] = reply
            except Exception as exc:
                reply.put((request_id, exc))
        return True

    def _step(self) -> None:
        try:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM has no request left but {len(self._routes)} were not answered")
            outputs = self.engine.step()
        except Exception as exc:
            routes, self._routes = self._routes, {}
            for request_id, outbox in routes.items():
                outbox.put((request_id, exc))
            return
        for output in outputs:
            if output.finished:
                outbox = self._routes.pop(output.request_id, None)
                if outbox is not None:
                    outbox.put((output.request_id, output))


def write_peft_dir(path: str, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (PEFT's saved names) as a PEFT adapter directory: what vLLM's ``PEFTHelper.from_local_dir`` and
    ``LoRAModel.from_local_checkpoint`` read (vllm/lora/peft_helper.py, vllm/lora/lora_model.py)."""
    from safetensors.torch import save_file

    os.makedirs(path)
    staged = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    save_file(staged, os.path.join(path, "adapter_model.safetensors"))
    config = spec.peft_config()
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def _salt(version: int) -> str:
    """The ``cache_salt`` of requests added under policy ``version``: vLLM mixes it into the first block's hash
    (``generate_block_hash_extra_keys``), so requests of one version share prefixes (a later turn reuses its
    conversation's KV) and never reuse another version's."""
    return f"relayrl-v{version}"


def _finished(
    outbox: queue.SimpleQueue,
    pending: dict[str, tuple[int, int]],
    version: int,
    routing: RoutingLayout | None,
    *,
    block: bool,
) -> Iterator[EngineCompletion]:
    """The completions waiting in ``outbox`` (removed from ``pending``): one waited for up to POLL_S when
    ``block``, else all there are now; ``version``: the one the call's requests were added under; ``routing``: how
    their routed experts read (routing replay; None: not asked for). Raises the engine's error for a request that
    failed."""
    while pending:
        try:
            request_id, output = outbox.get(timeout=POLL_S) if block else outbox.get_nowait()
        except queue.Empty:
            return
        if isinstance(output, BaseException):
            raise RuntimeError(f"vllm engine: {output}") from output
        if request_id in pending:
            p, s = pending.pop(request_id)
            yield _completion(p, s, output.outputs[0], version, routing)
        if block:
            return


def _completion(
    prompt_index: int, sample_index: int, output: Any, version: int, routing: RoutingLayout | None = None
) -> EngineCompletion:
    """A finished ``CompletionOutput`` as an EngineCompletion (logprob of each sampled token); ``token_versions``
    from its ``weight_versions`` spans when any token was sampled by another version than ``version``;
    ``routed_experts`` from its ``routed_experts`` ([tokens, layers, top_k], every token but the last:
    ``vllm/distributed/aux_output_connector/connector.py`` ``take_output``) when ``routing`` is given."""
    token_ids = list(output.token_ids)
    logprobs = [position[token].logprob for token, position in zip(token_ids, output.logprobs, strict=True)]
    reason = FINISH_REASONS.get(output.finish_reason)
    if reason is None:  # "error" (retryable) or another reason relayrl does not train on
        log.warning("vllm engine: sample finished with %r; reported as aborted", output.finish_reason)
        reason = "abort"
    versions = [int(span.version) for span in output.weight_versions or () for _ in range(span.start, span.end)]
    mixed = len(versions) == len(token_ids) and any(v != version for v in versions)
    routed = None if routing is None or output.routed_experts is None else routing.rows(output.routed_experts)
    return EngineCompletion(
        prompt_index, sample_index, token_ids, logprobs, reason, versions if mixed else None, routed
    )
