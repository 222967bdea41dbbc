"""A fake ``vllm`` module (vLLM 0.33.0's API, the part relayrl's ``vllm`` adapter uses), generating with the model
it loads, in an engine-core process of its own.

Mirrored, with vLLM's names, signatures and return shapes: ``LLM(model, *, tensor_parallel_size, dtype, seed,
gpu_memory_utilization, **engine_args)``, whose engine core runs in a separate process (vLLM's default
multiprocess mode); ``LLM.llm_engine`` (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``,
``get_num_unfinished_requests``, ``model_config.max_model_len``, ``engine_core.shutdown``);
``LLM.collective_rpc(method, timeout, args, kwargs)``: arguments and results cross the process boundary under
vLLM's msgpack rules (``msgpack_roundtrip``: tensors do not survive), one result per worker, a failure raised
as ``Exception("Call to collective_rpc method failed: ...")``; ``LLM.get_world_size``, ``LLM.reset_prefix_cache``;
``worker_extension_cls`` mixed into the worker class as ``vllm/v1/worker/worker_base.py`` does, each worker
holding vLLM's fused, sharded layout (``FusedShardModel``: ``qkv_proj``, ``gate_up_proj``, padded vocabulary);
``SamplingParams`` with its ``__post_init__`` rules, ``RequestOutputKind``, ``TokensPrompt``, ``RequestOutput``,
``CompletionOutput``, ``Logprob``. The scheduler batches continuously: every ``step`` advances every running
request by one token and admits waiting ones (up to ``max_num_seqs``), whichever call they came from. Logprobs
follow ``logprobs_mode`` ("raw_logprobs"; "processed_logprobs": after the min-tokens mask, temperature and vLLM's
top-p mask) by a teacher-forced forward.

Not emulated (refused with NotImplementedError where a caller could ask for it): n > 1, penalties, top-k,
min-p, top-n logprobs, output kinds other than FINAL_ONLY, pipeline parallelism. Tests read
``LLM.init_kwargs``, ``llm_engine.added`` / ``aborted`` / ``steps`` and ``LLM.fake_probe`` (test-only).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import multiprocessing
import threading
import time
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import NotRequired

from fakes.common import FusedShardModel, PrefixCache, RoutedExpertsCapture, run_on_ranks, vllm_top_p_mask
from relayrl.algorithms.routing_replay import routing_shape
from relayrl.rollout.hf import DTYPES, eos_token_ids, sample_step, stop_token_set
from relayrl.wire.sampling import SamplingParams as RelaySamplingParams
from relayrl.wire.sampling import first_stop, stop_text

__version__ = "0.33.0+fake"
# What a test puts into sys.modules to stand in for vLLM.
MODULES = ("vllm", "vllm.sampling_params", "vllm.lora", "vllm.lora.request")
SAMPLING_EPS = 1e-5  # vllm/sampling_params.py: _SAMPLING_EPS, temperatures below are greedy
MAX_TEMP = 1e-2  # vllm/sampling_params.py: _MAX_TEMP, smaller positive temperatures are raised to it
ZERO_COPY_THRESHOLD = 256  # vllm/envs.py: VLLM_MSGPACK_ZERO_COPY_THRESHOLD
ENGINE_ARGS = frozenset(  # the EngineArgs fields this fake understands (vllm/engine/arg_utils.py)
    {
        "max_num_seqs",
        "logprobs_mode",
        "worker_extension_cls",
        "max_model_len",
        "enforce_eager",
        "enable_prefix_caching",
        "generation_config",
        "block_size",
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "max_cpu_loras",
        "enable_return_routed_experts",
    }
)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class VLLMValidationError(ValueError):
    """vllm/exceptions.py: what SamplingParams' checks raise (a ValueError)."""


@dataclass(kw_only=True)
class SamplingParams:
    """The fields of ``vllm.SamplingParams`` relayrl may touch, with vLLM's defaults, and the rules of its
    ``__post_init__`` / ``_verify_args`` / ``_verify_greedy_sampling`` (vllm/sampling_params.py, 0.33.0) for them."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if 0 < self.temperature < MAX_TEMP:  # vLLM warns and raises it to the bound
            self.temperature = MAX_TEMP
        if self.seed == -1:
            self.seed = None
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        self._verify_args()
        if self.temperature < SAMPLING_EPS:  # greedy
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_args(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}."),
            (math.isfinite(self.temperature), f"temperature must be a finite number, got {self.temperature}."),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}."),
            (self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}."),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}."),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            ),
            (
                self.logprobs is None or self.logprobs == -1 or self.logprobs >= 0,
                f"logprobs must be non-negative or -1, got {self.logprobs}.",
            ),
            (
                all(isinstance(t, int) for t in self.stop_token_ids),
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}.",
            ),
            (all(self.stop), "stop cannot contain an empty string."),
            (
                not self.stop or self.detokenize,
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise VLLMValidationError(message)

    def unsupported(self) -> list[str]:
        """The fields set to something this fake cannot emulate."""
        neutral = {
            "n": 1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "prompt_logprobs": None,
            "output_kind": RequestOutputKind.FINAL_ONLY,
        }
        bad = [name for name, value in neutral.items() if getattr(self, name) != value]
        if self.logprobs not in (None, 0):
            bad.append("logprobs")
        if self.max_tokens is None:
            bad.append("max_tokens")
        return bad


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


@dataclass
class WeightVersionSpan:
    """vllm/outputs.py: output tokens ``[start, end)`` were sampled by weights labelled ``version``."""

    version: str
    start: int
    end: int


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    routed_experts: np.ndarray | None = None  # [seq_len - 1, layers, top_k] with enable_return_routed_experts

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: Any,
        outputs: list[CompletionOutput],
        finished: bool,
        **kwargs: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.num_cached_tokens = kwargs.get("num_cached_tokens")


@dataclass
class LoRARequest:
    """vllm/lora/request.py (a msgspec Struct there): ``load_inplace`` forces a reload from ``lora_path`` whenever
    a request carrying it is scheduled (``LRUCacheWorkerLoRAManager.add_adapter``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


# vllm/lora/worker_manager.py: _load_adapter's expected modules, Qwen2's supported_lora_modules expanded by
# packed_modules_mapping (qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj): the fused names are not in it
EXPECTED_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@dataclass
class LoRALayerWeights:
    """vllm/lora/lora_weights.py: ``optimize`` folds ``scaling`` into ``lora_b`` in place."""

    module_name: str
    rank: int
    scaling: float
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def optimize(self) -> None:
        if self.scaling != 1:
            self.lora_b *= self.scaling
            self.scaling = 1


@dataclass
class LoRAModel:
    id: int
    rank: int
    loras: dict[str, LoRALayerWeights]

    @classmethod
    def from_lora_tensors(cls, lora_model_id: int, tensors: dict[str, torch.Tensor], config: dict) -> LoRAModel:
        """vllm/lora/lora_model.py: the tensors are kept as given (``.to`` a device and dtype they already have
        does not copy), module names without PEFT's ``base_model.model.`` prefix; scaling alpha / r, or
        alpha / sqrt(r) with rsLoRA (vllm/lora/peft_helper.py)."""
        rank, alpha = config["r"], config["lora_alpha"]
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        loras: dict[str, LoRALayerWeights] = {}
        for name, tensor in tensors.items():
            module, _, part = name.removeprefix("base_model.model.").rpartition(".lora_")
            layer = loras.setdefault(module, LoRALayerWeights(module, rank, scaling))
            if part == "A.weight":
                layer.lora_a = tensor.to(dtype=torch.float32)
            else:
                layer.lora_b = tensor.to(dtype=torch.float32)
        return cls(lora_model_id, rank, loras)

    @classmethod
    def from_local_checkpoint(cls, lora_dir: str, lora_model_id: int) -> LoRAModel:
        """vllm/lora/lora_model.py: reads ``adapter_model.safetensors`` and ``adapter_config.json``; a module whose
        last name is not an expected LoRA module raises (``check_unexpected_modules``); one whose path is not in
        the model is accepted, and later matches nothing (vLLM #55193)."""
        import json
        import os

        from safetensors.torch import load_file

        with open(os.path.join(lora_dir, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        tensors = load_file(os.path.join(lora_dir, "adapter_model.safetensors"))
        unexpected = sorted(
            {
                module
                for module in (n.removeprefix("base_model.model.").rpartition(".lora_")[0] for n in tensors)
                if module.rsplit(".", 1)[-1] not in EXPECTED_LORA_MODULES
            }
        )
        if unexpected:
            raise ValueError(
                f"While loading {lora_dir}, expected target modules in {sorted(EXPECTED_LORA_MODULES)} but "
                f"received {unexpected}. Please verify that the loaded LoRA module is correct"
            )
        return cls.from_lora_tensors(lora_model_id, tensors, config)


class LoRAModelManager:
    """The worker's adapter manager (vllm/lora/model_manager.py): ``modules`` are the model's LoRA-capable layers
    (Hugging Face names here; vLLM keys them by its fused names), adapters by id; ``add_adapter`` runs
    ``optimize`` on every layer (``_create_merged_loras_inplace``)."""

    def __init__(self, module_names: list[str]) -> None:
        self.modules = dict.fromkeys(module_names)
        self._adapters: dict[int, LoRAModel] = {}

    def add_adapter(self, lora: LoRAModel) -> bool:
        for layer in lora.loras.values():
            layer.optimize()
        self._adapters[lora.id] = lora
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        return self._adapters.pop(adapter_id, None) is not None

    def get_adapter(self, adapter_id: int) -> LoRAModel | None:
        return self._adapters.get(adapter_id)

    def list_adapters(self) -> dict[int, LoRAModel]:
        return dict(self._adapters)


class LRUCacheWorkerLoRAManager:
    """vllm/lora/worker_manager.py: ``add_adapter`` loads from ``lora_path`` when the id is new or the request
    says ``load_inplace`` (then at every scheduling of a request carrying it); otherwise it keeps what it has.
    ``loads`` counts the loads from disk (test-only)."""

    def __init__(self, module_names: list[str]) -> None:
        self._adapter_manager = LoRAModelManager(module_names)
        self.loads = 0
        self.generation: dict[int, int] = {}  # adapter id -> how many times it was loaded (its weights' epoch)

    def add_adapter(self, lora_request: LoRARequest) -> bool:
        if lora_request.lora_int_id not in self._adapter_manager.list_adapters() or lora_request.load_inplace:
            lora = LoRAModel.from_local_checkpoint(lora_request.lora_path, lora_request.lora_int_id)
            self.loads += 1
            self.generation[lora.id] = self.loads
            self._adapter_manager.remove_adapter(lora.id)
            return self._adapter_manager.add_adapter(lora)
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        return self._adapter_manager.remove_adapter(adapter_id)

    def list_adapters(self) -> set[int]:
        return set(self._adapter_manager.list_adapters())


class FakeWorker:
    """What a vLLM GPU worker offers an extension: ``rank`` (in the engine), ``local_rank``, ``device``,
    ``model_runner.get_model()`` (a ``FusedShardModel``: vLLM's fused names, this rank's shard)."""

    def __init__(self, rank: int, model: FusedShardModel, lora_modules: list[str] | None = None) -> None:
        self.rank = rank
        self.local_rank = rank
        self.device = torch.device("cpu")
        manager = LRUCacheWorkerLoRAManager(lora_modules) if lora_modules is not None else None
        self.model_runner = types.SimpleNamespace(get_model=lambda: model, lora_manager=manager)


def resolve_obj_by_qualname(qualname: str) -> Any:
    """``pkg.module.Name`` -> the object (vllm/utils/import_utils.py)."""
    module_name, _, obj_name = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), obj_name)


def worker_class(extension_qualname: str) -> type:
    """FakeWorker with the extension mixed in, refusing attribute clashes as vLLM's ``init_worker`` does."""
    if not extension_qualname:
        return FakeWorker
    extension = resolve_obj_by_qualname(extension_qualname)
    for attr in dir(extension):
        if not attr.startswith("__") and hasattr(FakeWorker, attr):
            raise AssertionError(f"Worker class {FakeWorker} already has an attribute {attr}")
    return type("FakeWorkerWithExtension", (FakeWorker, extension), {})


# -- vllm/v1/serial_utils.py: what crosses between LLM and its engine-core process ------------------------------
def msgpack_roundtrip(obj: Any) -> Any:
    """``obj`` as the engine core's generic MsgpackDecoder (no type information) gets it from MsgpackEncoder:
    tuples become lists, enums their value, dataclasses dicts; a tensor becomes ``[dtype, shape, data]`` where
    data is its bytes below ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` (256) and otherwise the index of an out-of-band
    buffer, which an untyped decode never reads (the bytes are lost); anything else raises TypeError as
    ``enc_hook`` does without VLLM_ALLOW_INSECURE_SERIALIZATION. The same rules apply to utility results
    (``UtilityResult`` encodes as ``(None, result)``)."""
    buffers = [b""]

    def encode(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if isinstance(value, dict):
            return {encode(k): encode(v) for k, v in value.items()}
        if isinstance(value, enum.Enum):
            return value.value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            if value.nbytes < ZERO_COPY_THRESHOLD and value.is_cpu:
                data: Any = value.contiguous().view(torch.uint8).numpy().tobytes()
            else:
                data = len(buffers)
                buffers.append(b"")  # the payload travels out of band; a decoder without a type drops it
            return [dtype, list(value.shape), data]
        raise TypeError(
            f"Object of type {type(value)} is not serializableSet VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow "
            "fallback to pickle-based serialization."
        )

    return encode(obj)


# -- the engine-core process -----------------------------------------------------------------------------------
@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)  # the weight label that sampled each token
    logprob_rows: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each token's, when sampled
    kv_epochs: list[Any] = dataclasses.field(default_factory=list)  # the weights each KV position was computed under
    cached: int = 0  # prompt tokens served by the prefix cache
    routed: torch.Tensor | None = None  # enable_return_routed_experts: the last step's routed experts

    def cache_key(self) -> Any:
        """What a block hash mixes in beside the tokens (``generate_block_hash_extra_keys``)."""
        lora = (self.lora.lora_name, self.lora.lora_path) if self.lora is not None else None
        return ("salt", self.cache_salt, "lora", lora)


class EngineCore:
    """Runs in its own process, as vLLM's ``EngineCoreProc`` (vllm/v1/engine/core.py): the scheduler (token by
    token continuous batching: every step advances every running request by one token; waiting requests are
    admitted up to ``max_num_seqs`` between steps) and the executor's workers (TP ranks, threads here)."""

    def __init__(self, model: str, dtype: str, seed: int, tp_size: int, kwargs: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES["float32" if dtype == "auto" else dtype])
        self.hf.eval().requires_grad_(False)
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos = eos_token_ids(tokenizer, self.hf.generation_config)
        self.max_model_len = kwargs.get("max_model_len") or self.hf.config.max_position_embeddings
        self.max_num_seqs = kwargs.get("max_num_seqs") or 256
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise NotImplementedError(
                f"the fake emulates raw_logprobs and processed_logprobs, not {self.logprobs_mode}"
            )
        hf_params = {name: p.detach().clone() for name, p in self.hf.named_parameters()}
        tied = bool(self.hf.config.tie_word_embeddings)
        cls = worker_class(kwargs.get("worker_extension_cls", ""))
        self.max_lora_rank = kwargs.get("max_lora_rank") or 16
        lora_modules = None
        if kwargs.get("enable_lora"):
            lora_modules = [n for n, m in self.hf.named_modules() if n.rsplit(".", 1)[-1] in EXPECTED_LORA_MODULES]
        self.workers = [
            cls(rank, FusedShardModel(hf_params, rank, tp_size, tied=tied), lora_modules) for rank in range(tp_size)
        ]
        self._synced = 0
        self._seeds = torch.Generator().manual_seed(seed)
        self.waiting: OrderedDict[str, _Request] = OrderedDict()
        self.running: list[_Request] = []
        # vllm/config/cache.py: enable_prefix_caching (default True), block_size (16 on GPUs)
        self.prefix_caching = kwargs.get("enable_prefix_caching", True)
        self.cache = PrefixCache(kwargs.get("block_size") or 16)
        self.epoch = 0  # bumped by every weight load: which weights computed a KV block
        self.paused = False  # PauseState.PAUSED_ALL
        self.weight_version = "default"  # EngineCore._weight_version
        self.admissions: dict[str, tuple[int, int, bool]] = {}  # request id -> (prompt, cached, stale KV reused)
        # vllm/config/aux_output.py: enable_return_routed_experts
        self.routing = RoutedExpertsCapture(self.hf) if kwargs.get("enable_return_routed_experts") else None

    # utility methods (reached through call_utility)
    def collective_rpc(self, method: str, timeout: float | None, args: list, kwargs: dict) -> list[Any]:
        """``method`` on every worker at once; with more than one worker a failure comes back as
        MultiprocExecutor reports it (vllm/v1/executor/multiproc_executor.py), with one it propagates as is."""

        def call(rank: int) -> Any:
            try:
                return getattr(self.workers[rank], method)(*args, **kwargs)
            except Exception as exc:
                if len(self.workers) == 1:
                    raise
                raise RuntimeError(
                    f"Worker failed with error '{exc}', please check the stack trace above for the root cause"
                ) from exc

        return run_on_ranks(len(self.workers), call)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """False while any request holds KV blocks (running, or frozen by a "keep" pause): ``BlockPool.
        reset_prefix_cache`` refuses then (vllm/v1/core/block_pool.py); preempting them is not emulated."""
        if reset_running_requests:
            raise NotImplementedError("the fake does not preempt running requests")
        if self.running:
            return False
        self.cache.reset()
        return True

    # pause (vllm/v1/engine/core.py: EngineCoreProc.pause_generation / pause_scheduler / resume_scheduler)
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """ "keep": freeze every request where it is (PAUSED_ALL: the scheduler schedules nothing; requests keep
        their KV); "abort": abort them all. ``clear_cache`` resets the prefix cache, which fails (RuntimeError, as
        ``_reset_caches``) while requests hold blocks."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "wait":
            raise NotImplementedError("the fake does not emulate the 'wait' pause")
        if mode == "abort":
            self.abort_requests([r.request_id for r in self.running] + list(self.waiting))
        self.paused = True
        if clear_cache and not self.reset_prefix_cache():
            raise RuntimeError("Failed to reset the KV connector cache.")

    def resume_scheduler(self) -> None:
        self.paused = False

    def is_scheduler_paused(self) -> bool:
        return self.paused

    def set_weight_version(self, weight_version: str) -> None:
        self.weight_version = weight_version

    # LoRA (vllm/v1/engine/core.py: add_lora, remove_lora, list_loras -> every worker's lora manager)
    def _lora_managers(self) -> list[LRUCacheWorkerLoRAManager]:
        managers = [w.model_runner.lora_manager for w in self.workers]
        if managers[0] is None:
            raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return managers

    def add_lora(self, request: list) -> bool:
        lora_request = LoRARequest(*request)  # a msgspec array_like Struct arrives as a list
        return all(m.add_adapter(lora_request) for m in self._lora_managers())

    def remove_lora(self, lora_id: int) -> bool:
        return all(m.remove_adapter(lora_id) for m in self._lora_managers())

    def list_loras(self) -> list[int]:
        return sorted(self._lora_managers()[0].list_adapters())

    def _epoch(self, r: _Request) -> Any:
        """The weights a request's KV is computed under now: the base weights' epoch, and its adapter's load."""
        if r.lora is None:
            return self.epoch
        manager = self._lora_managers()[0]
        manager.add_adapter(r.lora)
        return (self.epoch, r.lora.lora_int_id, manager.generation[r.lora.lora_int_id])

    def _lora_params(self, r: _Request) -> dict[str, torch.Tensor] | None:
        """The weights a LoRA request is served with: W + B A for each layer of the adapter that is one of the
        model's modules (others match nothing); None for no adapter. Schedules the adapter first, as
        ``_apply_adapters`` does every step (a ``load_inplace`` request reloads it)."""
        if r.lora is None:
            return None
        manager = self._lora_managers()[0]
        manager.add_adapter(r.lora)
        lora = manager._adapter_manager.get_adapter(r.lora.lora_int_id)
        params = dict(self.hf.named_parameters())
        out = {}
        for module, layer in lora.loras.items():
            if module in manager._adapter_manager.modules:
                weight = params[f"{module}.weight"]
                out[f"{module}.weight"] = weight + layer.scaling * layer.lora_b @ layer.lora_a
        return out

    def get_weight_version(self) -> str:
        return self.weight_version

    def fake_probe(self, what: str) -> Any:
        """Test-only: what a test may read of the engine process (named so: no vLLM method)."""
        if what == "loaded_names":
            return [list(w.model_runner.get_model().loaded_names) for w in self.workers]
        if what == "group_ranks":
            return [w.relayrl_receiver.group.rank for w in self.workers]
        if what == "lora_loads":
            return [w.model_runner.lora_manager.loads for w in self.workers]
        if what == "admissions":
            return {rid: list(a) for rid, a in self.admissions.items()}
        raise ValueError(what)

    # requests
    def add_request(
        self, request_id: str, prompt: list[int], fields: dict[str, Any], salt: str | None, lora: LoRARequest | None
    ) -> None:
        params = SamplingParams(**fields)
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 62, (1,), generator=self._seeds))
        generator = torch.Generator().manual_seed(seed)
        self.waiting[request_id] = _Request(request_id, prompt, params, generator, cache_salt=salt, lora=lora)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)
        self.running = [r for r in self.running if r.request_id not in set(request_ids)]

    def _admit(self, r: _Request) -> None:
        """Prefill: the prefix cache serves what it holds for the prompt (under the request's key); the rest is
        computed now, under the current weights, and cached."""
        served = self.cache.match(r.prompt, r.cache_key()) if self.prefix_caching else []
        r.cached = len(served)
        epoch = self._epoch(r)
        r.kv_epochs = served + [epoch] * (len(r.prompt) - len(served))
        self.admissions[r.request_id] = (len(r.prompt), r.cached, any(e != epoch for e in served))
        if self.prefix_caching:
            self.cache.insert(r.prompt, r.kv_epochs, r.cache_key())

    @torch.no_grad()
    def step(self) -> tuple[list[RequestOutput], list[str], bool]:
        """One scheduler step: (the outputs of the requests that finished, the ids of every request in it, whether
        the scheduler is paused). Paused ("keep"), it schedules nothing."""
        self._sync_weights()
        if self.paused:
            return [], [], True
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popitem(last=False)[1]
            self._admit(r)
            self.running.append(r)
        batch = [r.request_id for r in self.running]
        outputs, still = [], []
        for r in self.running:
            relay = RelaySamplingParams(
                temperature=0.0 if r.params.temperature < SAMPLING_EPS else r.params.temperature,
                top_p=r.params.top_p,
                max_tokens=r.params.max_tokens,
                stop_token_ids=tuple(r.params.stop_token_ids),
                min_tokens=r.params.min_tokens,
                ignore_eos=r.params.ignore_eos,
            )
            ids = torch.tensor([r.prompt + r.output])
            adapted = self._lora_params(r)
            if adapted is None:
                logits = self.hf(input_ids=ids).logits[:, -1]
            else:
                out = torch.func.functional_call(self.hf, adapted, (), {"input_ids": ids}, strict=False)
                logits = out.logits[:, -1]
            if self.routing is not None:
                r.routed = self.routing.take()
            banned = None
            if len(r.output) < relay.min_tokens:
                banned = torch.tensor(sorted(self.eos | set(relay.stop_token_ids)))
            token = int(sample_step(logits, relay, r.generator, banned=banned)[0][0])
            r.logprob_rows.append(self._process(logits.float(), r.params, len(r.output))[0])
            if r.output:
                r.kv_epochs.append(self._epoch(r))  # this step computed the KV of the previous token
            r.output.append(token)
            r.versions.append(self.weight_version)
            if token in stop_token_set(frozenset(self.eos), relay):
                outputs.append(self._finish(r, "stop", token if token in relay.stop_token_ids else None))
            elif (matched := self._stop_string(r)) is not None:
                outputs.append(self._finish(r, "stop", matched))
            elif len(r.output) >= relay.max_tokens:
                outputs.append(self._finish(r, "length", None))
            else:
                still.append(r)
        self.running = still
        return outputs, batch, False

    def _sync_weights(self) -> None:
        """Generate with what the workers' (fused, sharded) tensors hold: rebuilt when a load happened."""
        loads = sum(len(w.model_runner.get_model().loaded_names) for w in self.workers)
        if loads != self._synced:
            full = FusedShardModel.gather([w.model_runner.get_model() for w in self.workers])
            params = dict(self.hf.named_parameters())
            with torch.no_grad():
                for name, tensor in full.items():
                    params[name].copy_(tensor)
            self._synced = loads
            self.epoch += 1

    def _stop_string(self, r: _Request) -> str | None:
        """The stop string the output's detokenized text now holds, as vLLM's detokenizer checks after each token
        (vllm/v1/engine/detokenizer.py; it ends the request as "stop" with the string as its stop_reason)."""
        if not r.params.stop:
            return None
        found = first_stop(self._text(r), r.params.stop)
        return None if found is None else self._text(r)[found[0] : found[1]]

    def _text(self, r: _Request) -> str:
        """The output's text: detokenized (skip_special_tokens) when the request asks for it, else ""."""
        if not r.params.detokenize:
            return ""
        return self.tokenizer.decode(r.output, skip_special_tokens=r.params.skip_special_tokens)

    def _finish(self, r: _Request, reason: str, stop_reason: int | str | None) -> RequestOutput:
        if self.prefix_caching:  # a finished request's full blocks stay cached
            self.cache.insert(r.prompt + r.output, r.kv_epochs, r.cache_key())
        logprobs = None
        if r.params.logprobs is not None:
            rows = r.logprob_rows
            logprobs = [
                {token: Logprob(float(row[token]), rank=int((row > row[token]).sum()) + 1)}
                for token, row in zip(r.output, rows, strict=True)
            ]
        text = self._text(r)
        if isinstance(stop_reason, str):  # vLLM cuts the text at the stop string; the token ids stay whole
            text = stop_text(text, [stop_reason], r.params.include_stop_str_in_output)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(r.output),
            cumulative_logprob=sum(p[t].logprob for t, p in zip(r.output, logprobs)) if logprobs else None,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            weight_versions=_spans(r.versions),
            routed_experts=None if r.routed is None else _routed_array(r.routed, self.hf),
        )
        return RequestOutput(r.request_id, None, r.prompt, None, [completion], True, num_cached_tokens=r.cached)

    def _process(self, logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
        """Logprobs [rows, V] as vLLM's sampler returns them, at the step that samples them, under
        ``logprobs_mode`` (vllm/v1/sample/sampler.py: ``Sampler.forward``; rows from output ``position`` on): raw
        ones from the logits as they come; processed ones after the logits processors (min-tokens: EOS and stop
        tokens at -inf while fewer than ``min_tokens`` are out, vllm/v1/sample/logits_processor/builtin.py),
        temperature and the top-p mask. (A request that lives through a weight update gets its later logits
        from a full forward with the new weights: the fake recomputes where vLLM keeps the old KV.)"""
        if self.logprobs_mode == "processed_logprobs":
            masked = max(0, min(len(logits), params.min_tokens - position))
            logits[:masked, sorted(self.eos | set(params.stop_token_ids))] = float("-inf")
            if params.temperature >= SAMPLING_EPS:
                logits = vllm_top_p_mask(logits / params.temperature, params.top_p)
        return logits.log_softmax(dim=-1)


def _routed_array(routed: torch.Tensor, model: torch.nn.Module) -> np.ndarray:
    """``CompletionOutput.routed_experts`` as vLLM returns it: uint8 up to 256 experts, else uint16
    (routed_experts_capturer.py: ``output_dtype_name``)."""
    experts = routing_shape(model)[2]
    return routed.numpy().astype(np.uint8 if experts <= 256 else np.uint16)


def _spans(versions: list[str]) -> list[WeightVersionSpan]:
    """vllm/v1/engine/output_processor.py: ``_weight_version_spans`` (set on the final output only)."""
    spans: list[WeightVersionSpan] = []
    for index, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1].end = index + 1
        else:
            spans.append(WeightVersionSpan(version, index, index + 1))
    return spans


def core_main(conn: Any, model: str, dtype: str, seed: int, tp_size: int, kwargs: dict[str, Any]) -> None:
    """The engine-core process: build the core, then answer the client's calls one at a time. A utility
    call's failure comes back as ``Call to <method> method failed: <error>`` (vllm/v1/engine/core.py:
    ``_invoke_utility_method``); its arguments arrive and its result leaves through ``msgpack_roundtrip``."""
    try:
        core = EngineCore(model, dtype, seed, tp_size, kwargs)
    except Exception as exc:
        conn.send(("error", f"engine core failed to start: {exc!r}"))
        return
    conn.send(("ok", core.max_model_len))
    while True:
        kind, name, args = conn.recv()
        if kind == "shutdown":
            conn.send(("ok", None))
            return
        try:
            if kind == "utility":
                result = msgpack_roundtrip(getattr(core, name)(*msgpack_roundtrip(args)))
            else:
                result = getattr(core, name)(*args)
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"Call to {name} method failed: {exc}"))


class EngineCoreClient:
    """``SyncMPClient`` (vllm/v1/engine/core_client.py): the LLM's side of the engine-core process. Requests
    (typed structs in vLLM) travel as they are; utility calls go through the msgpack rules; a failed utility
    call raises ``Exception(failure_message)`` as ``_process_utility_output`` does. Thread-safe."""

    def __init__(self, model: str, dtype: str, seed: int, tp_size: int, kwargs: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "transformers", __name__])
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=core_main, args=(child, model, dtype, seed, tp_size, kwargs), daemon=True)
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        self.closed = False
        self.max_model_len = self._receive(timeout=600)

    def _receive(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError("Engine core process died")  # vLLM: EngineDeadError
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the fake engine core did not answer")
        status, value = self._conn.recv()
        if status == "error":
            raise Exception(value)
        return value

    def call_utility(self, method: str, *args: Any) -> Any:
        """``SyncMPClient.call_utility``: any engine-core method by name (arguments and result via msgpack)."""
        return self.call("utility", method, *args)

    def call(self, kind: str, name: str, *args: Any) -> Any:
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine core is shut down")
            self._conn.send((kind, name, args))
            return self._receive()

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._conn.send(("shutdown", "", ()))
                self._conn.recv()
        self.process.join(timeout=30)


class LLMEngine:
    """``LLM.llm_engine`` (vllm/v1/engine/llm_engine.py): requests go to the engine-core process; ``step`` runs one
    scheduler step there. Tests read ``added``, ``aborted`` and ``steps`` (the request ids of every step)."""

    def __init__(self, client: EngineCoreClient, logprobs_mode: str) -> None:
        self.client = client
        self.model_config = types.SimpleNamespace(max_model_len=client.max_model_len, logprobs_mode=logprobs_mode)
        self.engine_core = client
        self._unfinished: set[str] = set()
        self.added: list[tuple[str, TokensPrompt, SamplingParams]] = []
        self.aborted: list[str] = []
        self.steps: list[list[str]] = []

    def add_request(
        self,
        request_id: str,
        prompt: TokensPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> str:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        unsupported = params.unsupported()
        if unsupported:
            raise NotImplementedError(f"the fake vllm does not emulate SamplingParams {unsupported}")
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}  # a msgspec Struct's fields
        salt = prompt.get("cache_salt")
        ids = list(prompt["prompt_token_ids"])
        self.client.call("request", "add_request", request_id, ids, fields, salt, lora_request)
        self.added.append((request_id, prompt, params))
        self._unfinished.add(request_id)
        return request_id

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.client.call("request", "abort_requests", list(request_ids))
        self.aborted.extend(request_ids)
        self._unfinished.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """Blocks while the engine core is paused with nothing to report, as ``SyncMPClient.get_output`` does."""
        while True:
            outputs, batch, paused = self.client.call("request", "step")
            if not paused:
                break
            time.sleep(0.005)
        self.steps.append(batch)
        for output in outputs:
            self._unfinished.discard(output.request_id)
        return outputs

    def collective_rpc(self, method: str, timeout: float | None, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        return self.client.call("utility", "collective_rpc", method, timeout, args, kwargs)

    def set_weight_version(self, weight_version: str) -> None:
        self.client.call_utility("set_weight_version", weight_version)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vllm/v1/engine/llm_engine.py -> the engine core -> every worker's ``add_lora`` (loads it now)."""
        fields = [getattr(lora_request, f.name) for f in dataclasses.fields(lora_request)]
        return self.client.call_utility("add_lora", fields)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.client.call_utility("list_loras"))

    def get_weight_version(self) -> str:
        return self.client.call_utility("get_weight_version")


class LLM:
    """The offline entry point; its engine core runs in a separate process, as vLLM's default
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``). ``dtype="auto"`` loads float32 (the tiny models are saved so)."""

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.92,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.init_kwargs = {
            "model": model,
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            **kwargs,
        }
        self.world_size = tensor_parallel_size
        client = EngineCoreClient(model, dtype, seed, tensor_parallel_size, kwargs)
        self.llm_engine = LLMEngine(client, kwargs.get("logprobs_mode", "raw_logprobs"))
        self.prefix_cache_resets = 0
        self.rpc_calls: list[str] = []

    def get_world_size(self, include_dp: bool = True) -> int:
        return self.world_size

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on every worker of the engine-core process; results in worker-rank order."""
        self.rpc_calls.append(method)
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs or {})

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_cache_resets += 1
        return self.llm_engine.client.call("utility", "reset_prefix_cache", reset_running_requests, reset_connector)

    def update_weight_version(self, new_version: str) -> None:
        """vllm/entrypoints/rl/offline.py: ``RLOfflineMixin.update_weight_version`` (the label of later tokens)."""
        self.llm_engine.set_weight_version(new_version)

    def fake_probe(self, what: str) -> Any:
        """Test-only view into the engine-core process (``loaded_names``, ``group_ranks``, ``admissions``: request id
        -> [prompt tokens, tokens the prefix cache served, whether it served KV of other weights]); not vLLM's."""
        return self.llm_engine.client.call("utility", "fake_probe", what)
