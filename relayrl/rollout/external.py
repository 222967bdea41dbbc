"""What the engines that run their model in processes of their own (``vllm``, ``sglang``) share.

Such an engine's GPU ranks live in its own worker processes, out of the rollout worker's reach, so the
rollout worker hands weight sync to it (see ``docs/engines.md``): InitWeightSync becomes
``engine.init_weight_sync(GroupArgs)``, UpdateWeights becomes ``engine.receive_update(manifest)``, and
inside every engine process an ``EngineReceiver`` joins relayrl's broadcast group and loads the buckets
with the engine's own ``load_weights``.

Rank layout: the engine process of local rank r (vLLM: the worker's rank in the engine, TP x PP; SGLang:
the TP rank) is rank ``rank_offset + r`` of the group, ``rank_offset`` being the rank InitWeightSync gave
the rollout worker; an engine occupies ``weight_sync_ranks`` consecutive ranks.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from relayrl.algorithms.routing_replay import index_dtype, routing_shape
from relayrl.algorithms.routing_replay import unsupported_reason as routing_unsupported
from relayrl.errors import FailedPrecondition, InvalidArgument
from relayrl.rollout.hf import DTYPES, eos_token_ids
from relayrl.weightsync.checksum import ChecksumParts, manifest_checksum
from relayrl.weightsync.errors import WeightMismatch, WeightSyncError, WeightSyncTimeout
from relayrl.weightsync.filesystem import read_weights
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest, dtype_from_name, dtype_name
from relayrl.weightsync.packing import BufferPair
from relayrl.weightsync.receiver import receive_weights
from relayrl.weightsync.stats import ReceiveStats
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

# Exceptions an engine process reports by class name (results cross process boundaries as plain data).
_REPORTED: dict[str, type[Exception]] = {
    "WeightSyncError": WeightSyncError,
    "WeightSyncTimeout": WeightSyncTimeout,
    "FailedPrecondition": FailedPrecondition,
    "WeightMismatch": WeightMismatch,  # the bytes that landed are not the ones sent: the group is fine
    "ValueError": ValueError,
}


# The releases each adapter was read against (docs/engines.md); pyproject's extras pin the same ranges.
SUPPORTED_VERSIONS: dict[str, str] = {"vllm": ">=0.33.0,<0.34", "sglang": ">=0.5.23,<0.6"}


def install_hint(package: str) -> str:
    """The command that installs the supported range of ``package``."""
    return f"pip install 'relayrl[{package}]' (that is {package}{SUPPORTED_VERSIONS[package]})"


def version_supported(package: str, found: str) -> bool:
    """``found`` (a version string, maybe unparsable) lies in SUPPORTED_VERSIONS[package]."""
    try:
        return Version(found) in SpecifierSet(SUPPORTED_VERSIONS[package])
    except InvalidVersion:
        return False


def import_engine(package: str) -> ModuleType:
    """Import ``package`` (vllm, sglang) and check its ``__version__`` against SUPPORTED_VERSIONS.

    ImportError naming the supported range and the install command when it is missing or of another version.
    """
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise ImportError(f"the {package} engine needs {package}: {install_hint(package)} ({err})") from err
    found = str(getattr(module, "__version__", "unknown"))
    if not version_supported(package, found):
        wanted = f"{package}{SUPPORTED_VERSIONS[package]}"
        raise ImportError(f"the {package} engine supports {wanted}, found {found}: {install_hint(package)}")
    return module


def refuse_unmatched_logprobs(params: SamplingParams, engine: str, *, top_p: bool) -> None:
    """InvalidArgument for the settings under which ``engine``'s logprobs are not relayrl's (docs/engines.md).

    relayrl's logprob: log softmax(logits / T) before top-p and before the ``min_tokens`` mask (the trainer's).
    vLLM's and SGLang's sampled-token logprobs are taken after their min-tokens mask (renormalised over the
    tokens left), so ``min_tokens > 0`` is refused; ``top_p``: the engine also renormalises over the nucleus
    (vLLM), so ``top_p < 1`` is refused.
    """
    if params.min_tokens > 0:
        raise InvalidArgument(
            "params.min_tokens",
            f"the {engine} engine reports logprobs renormalised after its min-tokens mask, not the trainer's; "
            "use 0 (ignore_eos gives equal-length responses)",
        )
    if top_p and params.top_p < 1:
        raise InvalidArgument(
            "params.top_p",
            f"the {engine} engine reports logprobs renormalised over the top-p nucleus, not the trainer's; use 1",
        )


@dataclass(frozen=True)
class GroupArgs:
    """Where and how the engine's processes join relayrl's weight group (the fields of InitWeightSync)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineGroup:
    """The rollout worker's handle on a group the engine's processes joined: its name and how to leave it."""

    def __init__(self, group_name: str, close: Callable[[], None]) -> None:
        self.group_name = group_name
        self._close = close

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class HFModelInfo:
    """What an external engine needs to know of the Hugging Face checkpoint it serves, without loading it."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    specs: list[tuple[str, tuple[int, ...], torch.dtype]]  # the trainer's (name, shape, dtype), tied weights once
    routing: RoutingLayout | None  # its mixture-of-experts routing as routing replay records it; None: cannot
    routing_unsupported: str | None  # why ``routing`` is None

    def routing_layout(self, engine: str) -> RoutingLayout:
        """``routing``, or a ValueError naming ``algorithm.routing_replay``, ``engine`` and the reason."""
        if self.routing is None:
            raise ValueError(f"routing_replay (algorithm.routing_replay): {engine} engine: {self.routing_unsupported}")
        return self.routing


@dataclass(frozen=True)
class RoutingLayout:
    """How an external engine's routed experts (vLLM's ``CompletionOutput.routed_experts``, SGLang's
    ``meta_info["routed_experts"]``: every token of the sequence but the last, [tokens, layers, top_k]) become
    ``EngineCompletion.routed_experts``: ``layers`` MoE layers, ``top_k`` experts a token, indices of ``experts``."""

    layers: int
    top_k: int
    experts: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * index_dtype(self.experts).itemsize

    def rows(self, indices: Any) -> torch.Tensor:
        """``indices`` (an integer array of any dtype, flat or [tokens, layers, top_k]) as [tokens, layers, top_k]
        in the wire dtype (``routing_replay.index_dtype``)."""
        wide = index_dtype(self.experts) == torch.int16
        flat = np.asarray(indices).astype(np.int16 if wide else np.uint8).reshape(-1, self.layers, self.top_k)
        return torch.from_numpy(flat)


def hf_model_info(model_path: str, dtype: str) -> HFModelInfo:
    """Tokenizer, EOS ids (tokenizer + generation config) and weight specs of ``model_path``.

    The specs come from the model built on the meta device (no memory), so they carry the Hugging Face names
    the trainer sends, whatever layout (fused qkv, TP shards) the engine keeps internally.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # the checkpoint has no generation_config.json
        generation_config = None
    unsupported = routing_unsupported(skeleton)
    return HFModelInfo(
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, generation_config),
        vocab_size=config.vocab_size,
        specs=[(name, tuple(p.shape), p.dtype) for name, p in skeleton.named_parameters()],
        routing=None if unsupported else RoutingLayout(*routing_shape(skeleton)),
        routing_unsupported=unsupported,
    )


def tensors_to_wire(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """[name, dtype, shape, bytes] per tensor: plain data, which survives vLLM's msgpack RPC (a tensor does not:
    it arrives as ``[dtype, shape, buffer index]`` with its bytes dropped, ``vllm/v1/serial_utils.py``)."""
    out = []
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        out.append([name, dtype_name(tensor.dtype), list(tensor.shape), flat.view(torch.uint8).numpy().tobytes()])
    return out


def tensors_from_wire(items: Iterable[Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of ``tensors_to_wire`` (CPU tensors owning their memory)."""
    out = []
    for name, dtype, shape, data in items:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out.append((name, raw.view(dtype_from_name(dtype)).reshape(shape)))
    return out


def check_weights(
    specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]], weights: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """ValueError naming the first tensor that is not a weight of ``specs`` or has another shape."""
    shapes = {name: shape for name, shape, _ in specs}
    for name, tensor in weights:
        if name not in shapes:
            raise ValueError(f"{name}: no such parameter in the model")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the parameter's {shapes[name]}")


def adapter_module_count(
    tensors: dict[str, torch.Tensor], specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]], engine: str
) -> int:
    """How many modules an adapter sent under PEFT's names adapts; ValueError naming the first tensor that is not
    an unfused Hugging Face Linear's ``lora_A``/``lora_B`` of the model (vLLM expects the unfused names and
    refuses ``qkv_proj``/``gate_up_proj``; an adapter whose names match no module would serve the base model:
    vLLM #55193), a module without both, or an empty adapter."""
    from relayrl.rollout.lora import adapted_modules

    modules = adapted_modules(tensors)
    if not modules:
        raise ValueError(f"the {engine} engine got an adapter without tensors (it would serve the base model)")
    weights = {name for name, _, _ in specs}
    for module, parts in modules.items():
        fused = next((f for f in DEFAULT_PACKED if module.endswith(f".{f}")), None)
        if fused is not None:
            raise ValueError(f"{module}: a fused name; send the unfused ones ({', '.join(DEFAULT_PACKED[fused])})")
        if f"{module}.weight" not in weights:
            raise ValueError(f"{module}: no such module in the model (the adapter would serve the base model)")
        if set(parts) != {"a", "b"}:
            raise ValueError(f"{module}: lora_A and lora_B must both be sent")
    return len(modules)


# vLLM's and SGLang's Llama-family models fuse these (``packed_modules_mapping``; each piece split over TP ranks).
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class AppliedLayout:
    """Where each Hugging Face tensor of ``specs`` lives in an engine model's own parameters on one tensor-parallel
    rank: the inverse of the engine's ``load_weights``, so that what it applied can be read back and compared
    where the bytes are (views, no copies).

    Rules (vLLM and SGLang, Llama-family layouts): a piece of ``packed_modules_mapping`` (``q_proj`` in
    ``qkv_proj``, ...) is a block of rows of the fused tensor, each piece split into ``tp_size`` parts on dim 0;
    an engine tensor of the HF shape is the tensor (or a replica); one whose dim 1 is 1/tp_size of the HF one is
    this rank's column block (row parallel); one that differs on dim 0 only is this rank's block of the padded
    vocabulary. A tensor that fits none of these (not on this pipeline stage, replicated KV heads, quantized) is
    not read back: ``readable`` is False for it.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        specs: Sequence[tuple[str, tuple[int, ...], Any]],
        *,
        packed: dict[str, list[str]],
        tp_rank: int,
        tp_size: int,
    ) -> None:
        shapes = {name: tuple(shape) for name, shape, _ in specs}
        # HF name -> (engine tensor, dim, offset in it, start in the HF tensor, length)
        self._places: dict[str, tuple[torch.Tensor, int, int, int, int]] = {}
        for name, shape in shapes.items():
            place = _place(name, shape, shapes, params, packed, tp_rank, tp_size)
            if place is not None:
                self._places[name] = place
        self.complete = tp_size == 1 and len(self._places) == len(shapes)  # rank 0 can read every tensor whole

    def readable(self, name: str) -> bool:
        return name in self._places

    def applied(self, name: str) -> torch.Tensor:
        """The engine's view of its part of HF tensor ``name`` (the whole tensor when ``tp_size`` is 1)."""
        tensor, dim, offset, _, length = self._places[name]
        return tensor.narrow(dim, offset, length)

    def expected(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the HF tensor ``full`` this rank holds."""
        _, dim, _, start, length = self._places[name]
        return full.narrow(dim, start, length)


def _place(name, shape, shapes, params, packed, tp_rank, tp_size):
    """One entry of ``AppliedLayout`` (None when no rule fits)."""
    for fused, pieces in packed.items():
        piece = next((p for p in pieces if f".{p}." in name), None)
        if piece is None:
            continue
        target = params.get(name.replace(f".{piece}.", f".{fused}."))
        rows = [shapes.get(name.replace(f".{piece}.", f".{p}."), (0,))[0] // tp_size for p in pieces]
        if target is None or sum(rows) != target.shape[0] or tuple(target.shape[1:]) != shape[1:]:
            return None
        index = pieces.index(piece)
        return target, 0, sum(rows[:index]), tp_rank * rows[index], rows[index]
    target = params.get(name)
    if target is None or target.dim() != len(shape):
        return None
    if tuple(target.shape) == shape:
        return target, 0, 0, 0, shape[0] if shape else 0
    if len(shape) == 2 and target.shape[0] == shape[0] and target.shape[1] * tp_size == shape[1]:
        return target, 1, 0, tp_rank * target.shape[1], target.shape[1]
    if tuple(target.shape[1:]) == shape[1:]:
        start = min(tp_rank * target.shape[0], shape[0])  # a rank past the vocabulary holds padding only
        return target, 0, 0, start, max(0, min(target.shape[0], shape[0] - start))
    return None


class EngineReceiver:
    """One engine process's membership in relayrl's weight group, and its staging buffers (kept between updates).

    Lives inside the engine's process (a vLLM worker, an SGLang scheduler); ``local_rank`` is that process's
    rank within the engine (tensor-parallel rank = ``local_rank % tp_size``).
    """

    def __init__(self, device: torch.device | str, local_rank: int) -> None:
        self.device = torch.device(device)
        self.local_rank = local_rank
        self.group: WeightBroadcastGroup | None = None
        self.buffers = BufferPair(self.device)

    def join(self, args: GroupArgs) -> None:
        """Leave the current group (if any) and join ``args``'s as rank ``rank_offset + local_rank``.

        Never blocks: the rendezvous happens in the first collective (see ``WeightBroadcastGroup``).
        """
        self.close()
        self.group = WeightBroadcastGroup(
            args.master_address,
            args.master_port,
            args.rank_offset + self.local_rank,
            args.world_size,
            group_name=args.group_name,
            backend=args.backend,
            timeout_s=args.timeout_s,
            device=self.device,
        )

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    def receive(
        self,
        manifest: WeightManifest,
        model: Any,
        *,
        tp_size: int = 1,
        group: GroupArgs | None = None,
    ) -> dict[str, Any]:
        """Receive (broadcast) or read (filesystem) every tensor of ``manifest``, load it with
        ``model.load_weights(weights=views)`` and check, chunk by chunk while the views are alive, that the
        model's own parameters hold exactly the received bytes (``AppliedLayout``; FailedPrecondition naming the
        first tensor that differs). ``group``: join it first unless already a member. Never raises (it runs
        inside the engine's process).

        Returns plain data (it crosses process boundaries): on success ``checksum`` (local rank 0 only:
        ``manifest_checksum`` of the model's own tensors read back under the HF names when this rank holds them
        whole; with tensor parallelism, of the received tensors, each found applied on every rank), ``seconds``,
        ``nbytes``, ``buckets``, ``peak_extra_bytes``, ``unverified`` (tensors no rule could read back); on
        failure ``error`` and ``error_type`` (a broken group is left).
        """
        try:
            params = dict(model.named_parameters())
            packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED
            layout = AppliedLayout(
                params,
                [(t.name, t.shape, t.dtype) for t in manifest.tensors],
                packed=packed,
                tp_rank=self.local_rank % tp_size,
                tp_size=tp_size,
            )
            # the trainer's rule: the manifest's sampling, or its checksum's method (fingerprint when it sent none)
            received = ChecksumParts.for_manifest(manifest) if self.local_rank == 0 and not layout.complete else None
            unverified: list[str] = []

            def load(views: list[tuple[str, torch.Tensor]]) -> None:
                model.load_weights(weights=views)
                for name, view in views:
                    if not layout.readable(name):
                        unverified.append(name)
                    elif not torch.equal(layout.applied(name), layout.expected(name, view)):
                        raise FailedPrecondition(
                            f"checksum: {name}: the engine's parameters do not hold the received tensor after "
                            "load_weights"
                        )
                    if received is not None:
                        received.add(name, view)

            if group is not None and (self.group is None or self.group.group_name != group.group_name):
                self.join(group)
            if manifest.transport == "filesystem":
                stats = read_weights(manifest.path, manifest, load)
            elif self.group is None:
                raise WeightSyncError(f"engine rank {self.local_rank} has joined no weight group")
            else:
                stats = receive_weights(self.group, manifest, load, device=self.device, buffers=self.buffers)
        except Exception as exc:
            if isinstance(exc, WeightSyncError):
                self.close()
            return {"error": f"engine rank {self.local_rank}: {exc}", "error_type": type(exc).__name__}
        checksum = ""
        if self.local_rank == 0:
            if received is None:
                checksum = manifest_checksum(manifest, ((t.name, layout.applied(t.name)) for t in manifest.tensors))
            else:
                checksum = received.checksum()
        return {
            "checksum": checksum,
            "seconds": stats.seconds,
            "nbytes": stats.nbytes,
            "buckets": stats.buckets,
            "peak_extra_bytes": stats.peak_extra_bytes,
            "unverified": len(unverified),
        }


def collect_receipts(results: Sequence[dict[str, Any]]) -> tuple[ReceiveStats, str]:
    """(stats, checksum) from the per-rank results of ``EngineReceiver.receive`` (rank 0 first).

    Raises the first reported failure as its class (WeightSyncError, FailedPrecondition, ValueError;
    RuntimeError for any other) so the rollout worker treats it as it treats its own receive failing.
    """
    for result in results:
        if "error" in result:
            raise _REPORTED.get(result["error_type"], RuntimeError)(result["error"])
    unverified = sum(r.get("unverified", 0) for r in results)
    if unverified:
        log.warning("%d received tensors could not be read back from the engine's parameters to verify", unverified)
    first = results[0]
    stats = ReceiveStats(
        seconds=max(r["seconds"] for r in results),
        nbytes=first["nbytes"],
        buckets=first["buckets"],
        peak_extra_bytes=max(r["peak_extra_bytes"] for r in results),
    )
    return stats, first["checksum"]


def reject_reserved_options(options: dict, reserved: Iterable[str], engine: str, key: str) -> None:
    """``options`` (the config's ``key``: ``rollout.engine_options``, a judge's ``scorers.<name>.engine_options``) may
    not set what the adapter sets itself (ValueError naming ``key`` and them)."""
    clash = sorted(set(options) & set(reserved))
    if clash:
        raise ValueError(f"{key}: {', '.join(clash)} is set by the {engine} engine itself")
