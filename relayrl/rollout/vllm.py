"""The ``vllm`` engine: vLLM's offline ``LLM``, driven step by step, with relayrl's weight sync inside its workers.

Generation: every (prompt, sample) becomes one request (``n=1``, ``seed + sample_index``: what vLLM's own
``ParentRequest`` fan-out does for ``n > 1``), added to ``LLM.llm_engine`` and stepped until it finishes,
so each sample is yielded as soon as it is done and ``should_abort`` is checked between steps (then the
unfinished requests are aborted with ``abort_request``). Logprobs: ``logprobs=0`` (the sampled token only)
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
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from relayrl.errors import InvalidArgument
from relayrl.rollout.engine import EngineCompletion, FinishReason, InferenceEngine
from relayrl.rollout.external import (
    EngineGroup,
    EngineReceiver,
    GroupArgs,
    check_weights,
    collect_receipts,
    hf_model_info,
    import_engine,
    refuse_unmatched_logprobs,
    reject_reserved_options,
)
from relayrl.rollout.sampling import SamplingParams
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.stats import ReceiveStats

log = logging.getLogger(__name__)

EXTENSION = "relayrl.rollout.vllm.RelayRLWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_RESERVED = ("logprobs_mode", "worker_extension_cls", "model", "max_num_seqs")
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

    def relayrl_receive(self, manifest_json: str) -> dict[str, Any]:
        """Receive one update into the model; the receipt of ``EngineReceiver.receive``."""
        model = self.model_runner.get_model()
        return self.relayrl_get_receiver().receive(
            WeightManifest.from_json(manifest_json), lambda views: model.load_weights(weights=views)
        )

    def relayrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()
        model.load_weights(weights=[(name, t.to(self.device)) for name, t in weights])

    def relayrl_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """CPU copies of this worker's parameters, under vLLM's own names (fused, this rank's shard)."""
        return [(name, p.detach().to("cpu", copy=True)) for name, p in self.model_runner.get_model().named_parameters()]


class VLLMEngine(InferenceEngine):
    """vLLM backend (pause mode only). ``options`` go to ``vllm.LLM`` as they are (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``enforce_eager``, ``max_model_len``, ...), except those this adapter sets."""

    name = "vllm"
    receives_weights_itself: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        max_batch_size: int = 256,
        seed: int = 0,
        **options: Any,
    ) -> None:
        reject_reserved_options(options, _RESERVED, "vllm")
        vllm = import_engine("vllm")
        from vllm.sampling_params import RequestOutputKind

        self._vllm = vllm
        self._final_only = RequestOutputKind.FINAL_ONLY
        info = hf_model_info(model_path, dtype)
        self.tokenizer = info.tokenizer
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = info.vocab_size
        self._specs = info.specs
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
        self._batches = itertools.count()
        self._checksum = ""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[EngineCompletion]:
        """See ``InferenceEngine.generate``. Aborted samples carry no tokens (vLLM returns only final outputs).
        InvalidArgument for ``top_p < 1``, ``min_tokens > 0`` (logprobs not the trainer's) and temperature > 2."""
        refuse_unmatched_logprobs(params, "vllm", top_p=True)
        if params.temperature > MAX_TEMPERATURE:
            raise InvalidArgument("params.temperature", f"the vllm engine takes at most {MAX_TEMPERATURE}")
        engine = self.llm.llm_engine
        batch = next(self._batches)
        pending: dict[str, tuple[int, int]] = {}
        try:
            for p, prompt in enumerate(prompts):
                for s in range(params.n):
                    request_id = f"relayrl-{batch}-{p}-{s}"
                    prompt_ids = self._vllm.TokensPrompt(prompt_token_ids=list(prompt))
                    engine.add_request(request_id, prompt_ids, self._sampling_params(params, s))
                    pending[request_id] = (p, s)
            while pending:
                if should_abort is not None and should_abort():
                    aborted, pending = pending, {}
                    engine.abort_request(list(aborted))
                    yield from (EngineCompletion(p, s, [], [], "abort") for p, s in aborted.values())
                    return
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM has no request left but {len(pending)} were not answered")
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        p, s = pending.pop(output.request_id)
                        yield _completion(p, s, output.outputs[0])
        finally:
            if pending:  # the consumer stopped early: leave nothing running in the engine
                engine.abort_request(list(pending))

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
            detokenize=False,
            output_kind=self._final_only,
        )

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The Hugging Face specs the trainer sends (not vLLM's fused internal layout)."""
        return list(self._specs)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """CPU copies of worker 0's parameters, under vLLM's names (fused ``qkv_proj``/``gate_up_proj``, worker
        0's tensor-parallel shard). Not live: writing to them changes nothing; for inspection only."""
        yield from self.llm.collective_rpc("relayrl_named_weights")[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes against the checkpoint's, then load on every worker (through the RPC channel:
        meant for small updates; weight sync uses ``receive_update``) and drop the now stale prefix cache."""
        pairs = [(name, t.detach().to("cpu")) for name, t in weights]
        check_weights(self._specs, pairs)
        self.llm.collective_rpc("relayrl_load_weights", args=(pairs,))
        self.llm.reset_prefix_cache()

    # -- weight sync handed over by the rollout worker (see docs/engines.md) -------------------------------
    def init_weight_sync(self, args: GroupArgs) -> EngineGroup:
        """Every worker joins ``args``'s group as ``rank_offset + its rank``."""
        self.llm.collective_rpc("relayrl_init_weight_sync", args=(args.to_dict(),))
        return EngineGroup(args.group_name, lambda: self.llm.collective_rpc("relayrl_close_weight_sync"))

    def receive_update(self, manifest: WeightManifest) -> ReceiveStats:
        """Every worker receives (or reads) ``manifest``'s tensors and loads them; then the prefix cache is reset."""
        self._checksum = ""  # a failed update leaves no checksum behind
        results = self.llm.collective_rpc("relayrl_receive", args=(manifest.to_json(),))
        stats, self._checksum = collect_receipts(results)
        self.llm.reset_prefix_cache()
        return stats

    def loaded_checksum(self) -> str:
        """``weights_checksum`` of the tensors the last ``receive_update`` loaded; "" before the first."""
        return self._checksum

    def close(self) -> None:
        self.llm.collective_rpc("relayrl_close_weight_sync")
        self.llm.llm_engine.engine_core.shutdown()


def _completion(prompt_index: int, sample_index: int, output: Any) -> EngineCompletion:
    """A finished ``CompletionOutput`` as an EngineCompletion (logprob of each sampled token)."""
    token_ids = list(output.token_ids)
    logprobs = [position[token].logprob for token, position in zip(token_ids, output.logprobs, strict=True)]
    reason = FINISH_REASONS.get(output.finish_reason)
    if reason is None:  # "error" (retryable) or another reason relayrl does not train on
        log.warning("vllm engine: sample finished with %r; reported as aborted", output.finish_reason)
        reason = "abort"
    return EngineCompletion(prompt_index, sample_index, token_ids, logprobs, reason)
