"""A fake ``vllm`` module (vLLM 0.33.0's API, the part relayrl's ``vllm`` adapter uses), generating with HFEngine.

Mirrored, with vLLM's names, signatures and return shapes: ``LLM(model, *, tensor_parallel_size, dtype, seed,
gpu_memory_utilization, **engine_args)``; ``LLM.llm_engine`` (``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``get_num_unfinished_requests``, ``model_config.max_model_len``,
``engine_core.shutdown``); ``LLM.collective_rpc(method, timeout, args, kwargs)`` (one result per worker; a
worker's exception comes back as vLLM's executor reports it, a RuntimeError); ``LLM.get_world_size``,
``LLM.reset_prefix_cache``; ``worker_extension_cls`` injected into the worker class as
``vllm/v1/worker/worker_base.py`` does; ``SamplingParams``, ``RequestOutputKind``, ``TokensPrompt``,
``RequestOutput``, ``CompletionOutput``, ``Logprob``. Logprobs follow ``logprobs_mode`` ("raw_logprobs",
"processed_logprobs": temperature and vLLM's top-p mask applied) by a teacher-forced forward.

Not emulated (refused with NotImplementedError where a caller could ask for it): n > 1, penalties, top-k,
min-p, stop strings, top-n logprobs, output kinds other than FINAL_ONLY; vLLM's fused parameter names and
tensor-parallel shards (every fake worker holds the same full model under Hugging Face names); batching
(``step`` finishes the oldest request). Tests read ``LLM.init_kwargs``, ``llm_engine.added`` and
``llm_engine.aborted``.
"""

from __future__ import annotations

import enum
import importlib
import math
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired

from fakes.common import (
    FakeEngineModel,
    run_on_ranks,
    teacher_forced_logits,
    vllm_top_p_mask,
)
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.sampling import SamplingParams as RelaySamplingParams

__version__ = "0.33.0+fake"
# What a test puts into sys.modules to stand in for vLLM.
MODULES = ("vllm", "vllm.sampling_params")
SAMPLING_EPS = 1e-5  # vllm/sampling_params.py: _SAMPLING_EPS, temperatures below are greedy
MAX_TEMP = 1e-2  # vllm/sampling_params.py: _MAX_TEMP, smaller positive temperatures are raised to it
ENGINE_ARGS = frozenset(  # the EngineArgs fields this fake understands (vllm/engine/arg_utils.py)
    {
        "max_num_seqs",
        "logprobs_mode",
        "worker_extension_cls",
        "max_model_len",
        "enforce_eager",
        "enable_prefix_caching",
        "generation_config",
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
            "stop": [],
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


class FakeWorker:
    """What a vLLM GPU worker offers an extension: ``rank`` (in the engine), ``local_rank``, ``device``,
    ``model_runner.get_model()``."""

    def __init__(self, rank: int, model: FakeEngineModel) -> None:
        self.rank = rank
        self.local_rank = rank
        self.device = torch.device("cpu")
        self.model_runner = types.SimpleNamespace(get_model=lambda: model)


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


class LLMEngine:
    """``LLM.llm_engine``: requests are queued by ``add_request`` and finished one per ``step``."""

    def __init__(self, hf: HFEngine, logprobs_mode: str, max_model_len: int) -> None:
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise NotImplementedError(f"the fake emulates raw_logprobs and processed_logprobs, not {logprobs_mode}")
        self.hf = hf
        self.logprobs_mode = logprobs_mode
        self.model_config = types.SimpleNamespace(max_model_len=max_model_len, logprobs_mode=logprobs_mode)
        self.engine_core = types.SimpleNamespace(shutdown=self._shutdown, closed=False)
        self._queue: OrderedDict[str, tuple[list[int], SamplingParams]] = OrderedDict()
        self.added: list[tuple[str, TokensPrompt, SamplingParams]] = []
        self.aborted: list[str] = []

    def _shutdown(self, timeout: float | None = None) -> None:
        self.engine_core.closed = True

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
        self.added.append((request_id, prompt, params))
        self._queue[request_id] = (list(prompt["prompt_token_ids"]), params)
        return request_id

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for request_id in request_ids:
            self.aborted.append(request_id)
            self._queue.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self._queue)

    def step(self) -> list[RequestOutput]:
        """Finish the oldest request; [] when none is queued."""
        if not self._queue:
            return []
        request_id, (prompt, params) = self._queue.popitem(last=False)
        return [RequestOutput(request_id, None, prompt, None, [self._complete(prompt, params)], True)]

    def _complete(self, prompt: list[int], params: SamplingParams) -> CompletionOutput:
        relay = RelaySamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            seed=params.seed,
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
        )
        (done,) = self.hf.generate([prompt], relay)
        stop_reason = done.token_ids[-1] if done.token_ids and done.token_ids[-1] in relay.stop_token_ids else None
        logprobs = None
        if params.logprobs is not None:
            all_logprobs = self._logprobs(prompt, done.token_ids, params)
            logprobs = [
                {token: Logprob(float(row[token]), rank=int((row > row[token]).sum()) + 1)}
                for token, row in zip(done.token_ids, all_logprobs, strict=True)
            ]
        return CompletionOutput(
            index=0,
            text="",
            token_ids=list(done.token_ids),
            cumulative_logprob=sum(p[t].logprob for t, p in zip(done.token_ids, logprobs)) if logprobs else None,
            logprobs=logprobs,
            finish_reason=done.finish_reason,
            stop_reason=stop_reason,
        )

    def _logprobs(self, prompt: list[int], response: list[int], params: SamplingParams) -> torch.Tensor:
        """[len(response), V] logprobs as vLLM's sampler returns them under ``logprobs_mode``
        (vllm/v1/sample/sampler.py: ``Sampler.forward``): raw ones from the logits as they come; processed ones
        after the logits processors (min-tokens: EOS and stop tokens at -inf while fewer than ``min_tokens`` are
        out, vllm/v1/sample/logits_processor/builtin.py), temperature and the top-p mask."""
        logits = teacher_forced_logits(self.hf.model, prompt, response)
        if self.logprobs_mode == "processed_logprobs":
            banned = sorted(self.hf.eos_token_ids | set(params.stop_token_ids))
            logits[: params.min_tokens, banned] = float("-inf")
            if params.temperature >= SAMPLING_EPS:
                logits = vllm_top_p_mask(logits / params.temperature, params.top_p)
        return logits.log_softmax(dim=-1)


class LLM:
    """The offline entry point. ``dtype="auto"`` loads float32 (the tiny models are saved in float32)."""

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
        hf = HFEngine(
            model,
            dtype="float32" if dtype == "auto" else dtype,
            seed=seed,
            max_batch_size=kwargs.get("max_num_seqs") or 256,
        )
        max_model_len = kwargs.get("max_model_len") or hf.max_model_len
        self.llm_engine = LLMEngine(hf, kwargs.get("logprobs_mode", "raw_logprobs"), max_model_len)
        shared = FakeEngineModel(hf.model)
        cls = worker_class(kwargs.get("worker_extension_cls", ""))
        self.workers = [cls(rank, shared) for rank in range(tensor_parallel_size)]
        self.prefix_cache_resets = 0
        self.rpc_calls: list[str] = []

    def get_world_size(self, include_dp: bool = True) -> int:
        return len(self.workers)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on every worker at once; results in worker-rank order."""
        self.rpc_calls.append(method)

        def call(rank: int) -> Any:
            try:
                return getattr(self.workers[rank], method)(*args, **(kwargs or {}))
            except Exception as exc:
                raise RuntimeError(
                    f"Worker failed with error '{exc}', please check the stack trace above for the root cause"
                ) from exc

        return run_on_ranks(len(self.workers), call)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_cache_resets += 1
        return True
