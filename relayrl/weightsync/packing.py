"""Bucket packing: tensors <-> one flat uint8 buffer, laid out by a ``WeightManifest``.

``unpack_bucket`` returns views (no copy): tensor i is ``buffer[offset_i : offset_i + nbytes_i]``
reinterpreted as its dtype and shape, valid until the buffer is reused.

A bucket travels as chunks (``transfer_chunks``), so packing, the transfer and loading pipeline
inside a bucket too; sender and receiver derive the same chunks from the manifest and the group's
``chunk_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from relayrl.weightsync.manifest import BucketSpec, TensorSpec, WeightManifest, dtype_name

if TYPE_CHECKING:
    from relayrl.weightsync.group import WeightBroadcastGroup


class Chunk(NamedTuple):
    """Bytes [start, end) of a bucket; ``to_pack``: tensors to pack before sending it (those that start
    before ``end`` and were not packed for an earlier chunk); ``complete``: tensors whose last byte
    arrives with it."""

    start: int
    end: int
    to_pack: list[TensorSpec]
    complete: list[TensorSpec]


def transfer_chunks(manifest: WeightManifest, bucket: BucketSpec, chunk_bytes: int) -> list[Chunk]:
    """Split ``bucket`` into ceil(nbytes / chunk_bytes) chunks; every tensor is in exactly one
    ``to_pack`` and one ``complete`` list, in offset order."""
    specs = manifest.bucket_tensors(bucket.index)
    chunks, packed, completed = [], 0, 0
    for start in range(0, max(bucket.nbytes, 1), chunk_bytes):
        end = min(start + chunk_bytes, bucket.nbytes)
        first_pack, first_done, last = packed, completed, end == bucket.nbytes
        while packed < len(specs) and (specs[packed].offset < end or last):  # last: empty tensors at the end
            packed += 1
        while completed < len(specs) and specs[completed].offset + specs[completed].nbytes <= end:
            completed += 1
        chunks.append(Chunk(start, end, specs[first_pack:packed], specs[first_done:completed]))
    return chunks


class PackStep(NamedTuple):
    """One chunk on the sender: bytes [start, end) of its bucket, staged in ``piece`` (that range of a
    staging slot) and then broadcast; ``names`` / ``targets``: its tensors to pack and their views in
    the slot (each tensor in the step of the chunk where it starts)."""

    start: int
    end: int
    piece: torch.Tensor
    names: list[str]
    targets: list[torch.Tensor]


def pack_plan(manifest: WeightManifest, buffers: BufferPair, chunk_bytes: int) -> list[list[PackStep]]:
    """Per bucket, its chunks as PackSteps into slot k % 2 of ``buffers`` (prepared for the manifest).

    Valid while the layout, ``chunk_bytes`` and the slots stay the same: build once, reuse per update.
    """
    plan = []
    for k, bucket in enumerate(manifest.buckets):
        flat = buffers.slot(k, bucket.nbytes)
        plan.append(
            [
                PackStep(
                    chunk.start,
                    chunk.end,
                    flat[chunk.start : chunk.end],
                    [spec.name for spec in chunk.to_pack],
                    [tensor_view(flat, spec) for spec in chunk.to_pack],
                )
                for chunk in transfer_chunks(manifest, bucket, chunk_bytes)
            ]
        )
    return plan


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The bytes of ``spec`` inside the flat uint8 ``buffer`` as a tensor of its dtype and shape."""
    return buffer[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def pack_tensors(flat: torch.Tensor, specs: Sequence[TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors[spec.name]`` into its place in ``flat`` for each spec (ValueError on a mismatch).

    Sources may live on any device and be non-contiguous; neither dtype nor shape is converted.
    """
    for spec in specs:
        src = tensors[spec.name]
        if src.dtype != spec.dtype or tuple(src.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: got {dtype_name(src.dtype)} {list(src.shape)}, "
                f"the manifest says {dtype_name(spec.dtype)} {list(spec.shape)}"
            )
        tensor_view(flat, spec).copy_(src.detach())


def pack_bucket(
    bucket: BucketSpec, tensors: Mapping[str, torch.Tensor], manifest: WeightManifest, out: torch.Tensor
) -> torch.Tensor:
    """Copy the bucket's tensors into ``out`` (uint8, >= bucket.nbytes); return ``out[:bucket.nbytes]``."""
    _check_buffer("out", out, bucket)
    flat = out[: bucket.nbytes]
    pack_tensors(flat, manifest.bucket_tensors(bucket.index), tensors)
    return flat


def views(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into ``buffer``) for each spec."""
    return [(spec.name, tensor_view(buffer, spec)) for spec in specs]


def unpack_bucket(buffer: torch.Tensor, bucket: BucketSpec, manifest: WeightManifest) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of ``bucket``, viewing ``buffer`` in place (offset order)."""
    _check_buffer("buffer", buffer, bucket)
    return views(buffer, manifest.bucket_tensors(bucket.index))


def _check_buffer(field: str, buffer: torch.Tensor, bucket: BucketSpec) -> None:
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"{field}: need a uint8 buffer of >= {bucket.nbytes} bytes, got {buffer.dtype} {buffer.numel()}"
        )


def check_device(buffers: BufferPair, group: WeightBroadcastGroup) -> None:
    """ValueError unless the staging buffers live where the group's backend moves bytes (NCCL: the GPU)."""
    if buffers.device.type != group.device.type:
        raise ValueError(f"device: staging buffers on {buffers.device}, the weight group runs on {group.device}")


class BufferPair:
    """Two reusable flat uint8 buffers for double buffering; bucket k uses slot k % 2.

    Slot s is grown to the largest bucket it will hold (buckets s, s+2, ...) and kept for the next
    update; ``nbytes`` is the memory held, the peak extra memory of a transfer.
    """

    def __init__(self, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> None:
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self._slots: list[torch.Tensor | None] = [None, None]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._slots if b is not None)

    @property
    def identity(self) -> tuple[int, ...]:
        """Changes whenever a slot is (re)allocated: the key for anything holding views of the slots."""
        return tuple(b.data_ptr() if b is not None else 0 for b in self._slots)

    def prepare(self, buckets: Sequence[BucketSpec]) -> None:
        """Make sure each slot can hold its buckets: slot s needs max(nbytes of buckets[s::2])."""
        for slot in range(min(2, len(buckets))):
            need = max(b.nbytes for b in buckets[slot::2])
            if self._slots[slot] is None or self._slots[slot].numel() < need:
                self._slots[slot] = None  # free before allocating: never hold old + new
                self._slots[slot] = torch.empty(need, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)

    def slot(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer bucket ``k`` uses (after ``prepare``)."""
        buffer = self._slots[k % 2]
        if buffer is None or buffer.numel() < nbytes:
            raise RuntimeError("BufferPair.prepare must be called with the manifest's buckets first")
        return buffer[:nbytes]
