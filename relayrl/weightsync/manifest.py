"""The weight manifest: every tensor's place in a packed per-dtype bucket, plus the version it brings.

Layout rule (``build_manifest``): tensors are grouped by dtype (dtypes in order of first appearance,
tensors in the given order within a dtype) and packed into flat byte buckets of at most
``bucket_bytes``; every offset is a multiple of ``ALIGN`` bytes so each tensor's view is aligned.
A tensor larger than ``bucket_bytes`` gets a bucket of its own.

The layout (tensors + buckets) rarely changes between updates, so it has an id (``layout_id``): a
manifest may travel compact, naming its layout by id, to a receiver that keeps a ``LayoutCache``.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

import torch
from google.protobuf import json_format

from relayrl.v1 import common_pb2 as pb
from relayrl.wire.lora import LoraAdapterSpec

ALIGN = 256
DEFAULT_BUCKET_BYTES = 512 << 20
TRANSPORTS = ("broadcast", "filesystem")
# WeightManifest.verify: "fingerprint" (every block) or "sampled" (one block in ``sample_stride``) in band
# (broadcast), "off" (receivers check nothing), "" (by ``checksum``)
VERIFY = ("", "fingerprint", "sampled", "off")
IN_BAND = ("fingerprint", "sampled")
# WeightManifest.kind: every weight ("full"), a LoRA run's frozen base weights ("base") or its adapter ("adapter")
KINDS = ("full", "base", "adapter")

Spec = tuple[str, tuple[int, ...], torch.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the wire spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16; ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: unknown torch dtype {name!r}")
    return dtype


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """numel(shape) * itemsize(dtype)."""
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * dtype.itemsize


def align_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= n."""
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: ``nbytes`` bytes at byte ``offset`` of bucket ``bucket``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketSpec:
    """One flat byte buffer holding tensors of a single dtype."""

    index: int
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class WeightManifest:
    """One weight update. Construction checks the layout is self-consistent (ValueError otherwise)."""

    version: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[BucketSpec, ...]
    transport: str = "broadcast"
    path: str = ""
    checksum: str = ""
    verify: str = ""  # one of VERIFY; "fingerprint": the sender's fingerprint follows the buckets over the group
    sample_stride: int = 0  # verify "sampled": blocks b with (b + sample_phase) % sample_stride == 0 are checked
    sample_phase: int = 0
    kind: str = "full"  # one of KINDS
    lora: LoraAdapterSpec | None = None  # the adapter's shape: kind "adapter" (and "base") only
    _by_bucket: dict[int, list[TensorSpec]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "buckets", tuple(self.buckets))
        object.__setattr__(self, "_by_bucket", _check_layout(self))
        _check_kind(self.kind, self.lora)

    @property
    def total_bytes(self) -> int:
        """Payload bytes: the sum of every tensor's nbytes (bucket padding excluded)."""
        return sum(t.nbytes for t in self.tensors)

    def bucket_tensors(self, index: int) -> list[TensorSpec]:
        """The tensors of bucket ``index`` in offset order."""
        return self._by_bucket[index]

    def validate_against(self, specs: Sequence[Spec]) -> None:
        """ValueError naming the first tensor whose name, shape or dtype differs from ``specs``."""
        mine = {t.name: t for t in self.tensors}
        for name, shape, dtype in specs:
            spec = mine.pop(name, None)
            if spec is None:
                raise ValueError(f"{name}: missing from the manifest (version {self.version})")
            if spec.shape != tuple(shape):
                raise ValueError(f"{name}: shape {list(spec.shape)} in the manifest, {list(shape)} expected")
            if spec.dtype != dtype:
                raise ValueError(
                    f"{name}: dtype {dtype_name(spec.dtype)} in the manifest, {dtype_name(dtype)} expected"
                )
        if mine:
            raise ValueError(f"{next(iter(mine))}: in the manifest but not expected")

    @cached_property
    def layout_id(self) -> str:
        """sha256 of the layout alone (tensors + buckets, deterministic proto bytes): equal ids, same bytes
        at the same places."""
        layout = pb.WeightManifest(tensors=self._tensor_protos(), buckets=self._bucket_protos())
        return hashlib.sha256(layout.SerializeToString(deterministic=True)).hexdigest()

    def with_header(
        self,
        *,
        version: int,
        checksum: str = "",
        path: str = "",
        transport: str = "broadcast",
        verify: str = "",
        sample_stride: int = 0,
        sample_phase: int = 0,
        kind: str = "full",
        lora: LoraAdapterSpec | None = None,
    ) -> WeightManifest:
        """This layout for another update: a shallow copy with a new header (the layout, already checked,
        is shared with this manifest, and so is its computed ``layout_id``)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: {transport!r} is not one of {TRANSPORTS}")
        if verify != self.verify or (sample_stride, sample_phase) != (self.sample_stride, self.sample_phase):
            _check_verify(self.tensors, verify, sample_stride, sample_phase)
        _check_kind(kind, lora)
        manifest = copy.copy(self)
        header = {
            "version": version,
            "checksum": checksum,
            "path": path,
            "transport": transport,
            "verify": verify,
            "sample_stride": sample_stride,
            "sample_phase": sample_phase,
            "kind": kind,
            "lora": lora,
        }
        for name, value in header.items():
            object.__setattr__(manifest, name, value)
        return manifest

    def to_proto(self, *, compact: bool = False) -> pb.WeightManifest:
        """The wire form; ``compact``: the layout named by ``layout_id`` only (see ``LayoutCache``)."""
        return pb.WeightManifest(
            version=self.version,
            tensors=[] if compact else self._tensor_protos(),
            buckets=[] if compact else self._bucket_protos(),
            transport=self.transport,
            path=self.path,
            checksum=self.checksum,
            layout_id=self.layout_id,
            verify=self.verify,
            sample_stride=self.sample_stride,
            sample_phase=self.sample_phase,
            kind=self.kind,
            lora=_lora_proto(self.lora),
        )

    def _tensor_protos(self) -> list[pb.TensorSpec]:
        return [
            pb.TensorSpec(
                name=t.name, shape=t.shape, dtype=dtype_name(t.dtype), bucket=t.bucket, offset=t.offset, nbytes=t.nbytes
            )
            for t in self.tensors
        ]

    def _bucket_protos(self) -> list[pb.BucketSpec]:
        return [pb.BucketSpec(index=b.index, dtype=dtype_name(b.dtype), nbytes=b.nbytes) for b in self.buckets]

    @classmethod
    def from_proto(cls, msg: pb.WeightManifest) -> WeightManifest:
        """Inverse of ``to_proto`` (not compact); ValueError (naming the field) for an inconsistent layout,
        or a ``layout_id`` that is not the layout's."""
        manifest = cls(
            version=msg.version,
            tensors=tuple(
                TensorSpec(t.name, tuple(t.shape), dtype_from_name(t.dtype), t.bucket, t.offset, t.nbytes)
                for t in msg.tensors
            ),
            buckets=tuple(BucketSpec(b.index, dtype_from_name(b.dtype), b.nbytes) for b in msg.buckets),
            transport=msg.transport or "broadcast",  # proto3 default "" = unset
            path=msg.path,
            checksum=msg.checksum,
            verify=msg.verify,
            sample_stride=msg.sample_stride,
            sample_phase=msg.sample_phase,
            **kind_fields(msg),
        )
        if msg.layout_id and msg.layout_id != manifest.layout_id:
            raise ValueError(f"layout_id: {msg.layout_id[:12]} is not the id of the layout sent with it")
        return manifest

    def to_json(self) -> str:
        """The proto's canonical JSON (what the filesystem transport stores next to the shards)."""
        return json_format.MessageToJson(self.to_proto(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> WeightManifest:
        return cls.from_proto(json_format.Parse(text, pb.WeightManifest()))


def kind_fields(msg: pb.WeightManifest) -> dict:
    """``kind`` and ``lora`` of a wire manifest as the dataclass holds them (proto3's "" is "full"; a LoraSpec
    is present when ``msg.HasField("lora")``)."""
    lora = msg.lora
    spec = (
        LoraAdapterSpec(lora.rank, lora.alpha, tuple(lora.target_modules), lora.use_rslora)
        if msg.HasField("lora")
        else None
    )
    return {"kind": msg.kind or "full", "lora": spec}


def _lora_proto(spec: LoraAdapterSpec | None) -> pb.LoraSpec | None:
    if spec is None:
        return None
    return pb.LoraSpec(rank=spec.rank, alpha=spec.alpha, target_modules=spec.target_modules, use_rslora=spec.use_rslora)


def _check_kind(kind: str, lora: LoraAdapterSpec | None) -> None:
    """ValueError unless ``kind`` is known and an adapter carries a LoraSpec of positive rank and alpha (a
    "full" manifest carries none)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
    if kind == "adapter" and lora is None:
        raise ValueError("lora: an adapter manifest needs its LoraSpec (rank, alpha, target modules)")
    if kind == "full" and lora is not None:
        raise ValueError("lora: a full manifest carries no LoraSpec (kind 'base' or 'adapter')")
    if lora is not None and (lora.rank < 1 or not lora.alpha > 0 or not lora.target_modules):
        raise ValueError(f"lora: rank {lora.rank}, alpha {lora.alpha}, target modules {list(lora.target_modules)}")


def _check_layout(m: WeightManifest) -> dict[int, list[TensorSpec]]:
    """Check every invariant a receiver relies on; return the tensors of each bucket by offset."""
    if m.transport not in TRANSPORTS:
        raise ValueError(f"transport: {m.transport!r} is not one of {TRANSPORTS}")
    _check_verify(m.tensors, m.verify, m.sample_stride, m.sample_phase)
    by_bucket: dict[int, list[TensorSpec]] = {}
    for i, b in enumerate(m.buckets):
        if b.index != i or b.nbytes < 0:
            raise ValueError(f"buckets[{i}]: index {b.index}, nbytes {b.nbytes}")
        by_bucket[i] = []
    names: set[str] = set()
    for t in m.tensors:
        if t.name in names:
            raise ValueError(f"{t.name}: appears twice in the manifest")
        names.add(t.name)
        if not 0 <= t.bucket < len(m.buckets):
            raise ValueError(f"{t.name}: bucket {t.bucket} does not exist")
        bucket = m.buckets[t.bucket]
        if t.dtype != bucket.dtype:
            raise ValueError(f"{t.name}: dtype {dtype_name(t.dtype)} in a {dtype_name(bucket.dtype)} bucket")
        if any(d < 0 for d in t.shape) or t.nbytes != nbytes_of(t.shape, t.dtype):
            raise ValueError(f"{t.name}: nbytes {t.nbytes} does not match shape {list(t.shape)}")
        if t.offset < 0 or t.offset % t.dtype.itemsize or t.offset + t.nbytes > bucket.nbytes:
            raise ValueError(f"{t.name}: offset {t.offset} is misaligned or outside bucket {t.bucket}")
        by_bucket[t.bucket].append(t)
    for index, specs in by_bucket.items():
        specs.sort(key=lambda t: t.offset)
        for prev, cur in pairwise(specs):
            if prev.offset + prev.nbytes > cur.offset:
                raise ValueError(f"{cur.name}: overlaps {prev.name} in bucket {index}")
    return by_bucket


def _check_verify(tensors: Sequence[TensorSpec], verify: str, stride: int, phase: int) -> None:
    """ValueError unless ``verify`` is known, (in band) every tensor starts at an ALIGN multiple and (sampled
    only) the stride is a power of two and 0 <= phase < stride."""
    if verify not in VERIFY:
        raise ValueError(f"verify: {verify!r} is not one of {VERIFY}")
    if verify == "sampled":
        if stride < 1 or stride & (stride - 1):
            raise ValueError(f"sample_stride: {stride} is not a power of two")
        if not 0 <= phase < stride:
            raise ValueError(f"sample_phase: {phase} is not in [0, {stride})")
    elif stride or phase:
        raise ValueError(f"sample_stride: {stride}, sample_phase: {phase} need verify 'sampled', not {verify!r}")
    misaligned = next((t for t in tensors if t.offset % ALIGN), None) if verify in IN_BAND else None
    if misaligned is not None:
        raise ValueError(f"verify: {verify} needs offsets that are multiples of {ALIGN}, {misaligned.name} is not")


def build_manifest(
    specs: Sequence[Spec],
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "broadcast",
) -> WeightManifest:
    """Pack ``specs`` per dtype into buckets of at most ``bucket_bytes`` with ALIGN-aligned offsets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, dtype in specs:
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
    tensors: list[TensorSpec] = []
    buckets: list[BucketSpec] = []
    for dtype, entries in by_dtype.items():
        open_bucket, used = -1, 0
        for name, shape in entries:
            nbytes = nbytes_of(shape, dtype)
            offset = align_up(used)
            if open_bucket < 0 or offset + nbytes > bucket_bytes:
                open_bucket, offset = len(buckets), 0
                buckets.append(BucketSpec(open_bucket, dtype, 0))
            used = offset + nbytes
            buckets[open_bucket] = BucketSpec(open_bucket, dtype, used)
            tensors.append(TensorSpec(name, shape, dtype, open_bucket, offset, nbytes))
    return WeightManifest(version=version, tensors=tuple(tensors), buckets=tuple(buckets), transport=transport)


class ManifestBuilder:
    """Sender side: ``build_manifest`` once per set of specs, then only the header changes per update."""

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: str = "broadcast") -> None:
        self.bucket_bytes, self.transport = bucket_bytes, transport
        self._specs: list[Spec] = []
        self._layout: WeightManifest | None = None

    def build(
        self,
        specs: Sequence[Spec],
        *,
        version: int,
        checksum: str = "",
        path: str = "",
        verify: str = "",
        sample_stride: int = 0,
        sample_phase: int = 0,
        kind: str = "full",
        lora: LoraAdapterSpec | None = None,
    ) -> WeightManifest:
        specs = [(name, tuple(shape), dtype) for name, shape, dtype in specs]
        if self._layout is None or specs != self._specs:
            self._layout = build_manifest(specs, version=version, bucket_bytes=self.bucket_bytes)
            self._specs = specs
        return self._layout.with_header(
            version=version,
            checksum=checksum,
            path=path,
            transport=self.transport,
            verify=verify,
            sample_stride=sample_stride,
            sample_phase=sample_phase,
            kind=kind,
            lora=lora,
        )


class UnknownLayout(KeyError):
    """A compact manifest named a layout this receiver was never sent."""


class LayoutCache:
    """The last ``capacity`` layouts a receiver was sent in full, by ``layout_id``."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._layouts: OrderedDict[str, WeightManifest] = OrderedDict()

    def resolve(self, msg: pb.WeightManifest) -> WeightManifest:
        """The manifest ``msg`` stands for: parsed (and remembered) when it lists its layout, else this
        cache's layout ``msg.layout_id`` with msg's header. ValueError for a bad layout, UnknownLayout
        for a compact manifest whose layout is not here."""
        if msg.tensors or msg.buckets or not msg.layout_id:
            manifest = WeightManifest.from_proto(msg)
            self._layouts[manifest.layout_id] = manifest
        else:
            layout = self._layouts.get(msg.layout_id)
            if layout is None:
                raise UnknownLayout(msg.layout_id)
            manifest = layout.with_header(
                version=msg.version,
                checksum=msg.checksum,
                path=msg.path,
                transport=msg.transport or "broadcast",
                verify=msg.verify,
                sample_stride=msg.sample_stride,
                sample_phase=msg.sample_phase,
                **kind_fields(msg),
            )
        self._layouts.move_to_end(manifest.layout_id)
        while len(self._layouts) > self.capacity:
            self._layouts.popitem(last=False)
        return manifest
