"""The weights fingerprint: its formula (against a numpy reference), folding chunk by chunk as a transfer
lands, what it detects, the manifest's ``verify`` field and where trainer rank 0 keeps its arena."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from relayrl.bench.weightsync import random_tensors
from relayrl.config import WeightSyncConfig
from relayrl.trainer import sync
from relayrl.weightsync import (
    Fingerprinter,
    WeightArena,
    WeightManifest,
    arena_placement,
    build_manifest,
    weights_checksum,
)
from relayrl.weightsync.fingerprint import BLOCK, tensor_sums
from relayrl.weightsync.manifest import BucketSpec, TensorSpec
from relayrl.weightsync.packing import transfer_chunks

SPECS = [
    ("embed", (300, 24), torch.bfloat16),  # 14,400 B: blocks of 256 and a 64-byte tail
    ("odd", (7,), torch.bfloat16),  # 14 B: one partial block
    ("empty", (0, 3), torch.float32),
    ("bias", (5,), torch.float32),  # 20 B, then padding up to norm
    ("norm", (64,), torch.float32),  # exactly one block
    ("big", (40, 100), torch.float32),  # spans several chunks below
    ("step", (3,), torch.int64),
]


def reference_sums(tensor: torch.Tensor) -> tuple[int, int]:
    """s1, s2 of the module docstring, in numpy's uint64 (whose arithmetic wraps by definition)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % BLOCK)
    blocks = np.frombuffer(raw, dtype="<u8").reshape(-1, BLOCK // 8).sum(1, dtype=np.uint64)
    weights = np.arange(1, len(blocks) + 1, dtype=np.uint64)
    return int(blocks.sum(dtype=np.uint64)), int((blocks * weights).sum(dtype=np.uint64))


def test_sums_follow_the_formula_for_every_dtype_and_shape() -> None:
    tensors = random_tensors(SPECS)
    tensors["ints"] = torch.randint(-(2**62), 2**62, (100,), dtype=torch.int64)  # sums that overflow int64
    tensors["strided"] = tensors["big"].t()
    for name, tensor in tensors.items():
        got = tuple(int(v) % 2**64 for v in tensor_sums(tensor).tolist())
        assert got == reference_sums(tensor), name


def arena_with_garbage_padding(manifest: WeightManifest, tensors: dict[str, torch.Tensor]) -> WeightArena:
    arena = WeightArena(manifest)
    for bucket in arena.buckets:
        bucket.copy_(torch.randint(0, 256, bucket.shape, dtype=torch.uint8))
    arena.load(tensors.items())
    return arena


@pytest.mark.parametrize("chunk_bytes", [256, 1024, 4096, 1 << 20])
def test_chunks_folded_in_any_order_give_the_per_tensor_fingerprint(chunk_bytes: int) -> None:
    """Padding between tensors holds garbage (as a reused staging buffer does): it is masked out."""
    tensors = random_tensors(SPECS)
    manifest = build_manifest(SPECS, version=1, bucket_bytes=8192)
    arena = arena_with_garbage_padding(manifest, tensors)
    chunks = [
        (b.index, c.start, flat[c.start : c.end])
        for b, flat in zip(manifest.buckets, arena.buckets, strict=True)
        for c in transfer_chunks(manifest, b, chunk_bytes)
    ]
    fold = Fingerprinter(manifest, chunk_bytes, "cpu")
    for bucket, start, data in reversed(chunks):
        fold.add(bucket, start, data)
    assert fold.hexdigest() == weights_checksum(tensors.items()) == weights_checksum(arena.views())


def fold_arena(arena: WeightArena, chunk_bytes: int = 1024) -> str:
    fold = Fingerprinter(arena.manifest, chunk_bytes, "cpu")
    for bucket, flat in zip(arena.manifest.buckets, arena.buckets, strict=True):
        for chunk in transfer_chunks(arena.manifest, bucket, chunk_bytes):
            fold.add(bucket.index, chunk.start, flat[chunk.start : chunk.end])
    return fold.hexdigest()


def test_every_flipped_byte_of_a_tensor_is_detected_and_padding_is_not_weights() -> None:
    tensors = random_tensors(SPECS)
    manifest = build_manifest(SPECS, version=1, bucket_bytes=8192)
    arena = arena_with_garbage_padding(manifest, tensors)
    base = fold_arena(arena)
    spec = next(t for t in manifest.tensors if t.name == "embed")
    flat = arena.buckets[spec.bucket]
    end = spec.offset + spec.nbytes
    for offset in [*range(spec.offset, spec.offset + 9), *range(spec.offset + 9, end, 1021), end - 1]:
        flat[offset] ^= 0x01
        assert fold_arena(arena) != base, offset
        flat[offset] ^= 0x01
    assert fold_arena(arena) == base
    padded = next(
        t for t in manifest.tensors if t.nbytes % BLOCK and t.offset + t.nbytes < arena.buckets[t.bucket].numel()
    )
    arena.buckets[padded.bucket][padded.offset + padded.nbytes] ^= 0xFF  # padding: not part of the weights
    assert fold_arena(arena) == base


def test_stale_swapped_or_zeroed_blocks_are_detected() -> None:
    tensor = torch.randn(64, 64)  # 16 KiB: 64 blocks
    base = weights_checksum([("w", tensor)])
    swapped = tensor.clone().view(-1, BLOCK // 4)
    swapped[[3, 9]] = swapped[[9, 3]]
    stale = tensor.clone()
    stale.view(-1)[1000:1064] = torch.randn(64)  # one block from another version
    zeroed = tensor.clone()
    zeroed.view(-1)[:2048] = 0  # a torn load: the first half never arrived
    for other in (swapped, stale, zeroed):
        assert weights_checksum([("w", other.view(64, 64))]) != base


def test_verify_travels_in_the_manifest_and_needs_aligned_offsets() -> None:
    manifest = build_manifest(SPECS, version=1).with_header(version=2, verify="fingerprint")
    assert WeightManifest.from_proto(manifest.to_proto()).verify == "fingerprint"
    with pytest.raises(ValueError, match=r"^verify: 'crc32' is not one of"):
        manifest.with_header(version=3, verify="crc32")
    misaligned = (TensorSpec("a", (4,), torch.float32, 0, 0, 16), TensorSpec("b", (4,), torch.float32, 0, 16, 16))
    WeightManifest(1, misaligned, (BucketSpec(0, torch.float32, 32),))  # fine without a fingerprint
    with pytest.raises(ValueError, match=r"^verify: fingerprint needs offsets that are multiples of 256, b"):
        WeightManifest(1, misaligned, (BucketSpec(0, torch.float32, 32),), verify="fingerprint")


@pytest.mark.parametrize(
    ("backend", "free", "expected"),
    [
        ("gloo", None, ("cpu", False, False)),  # host memory, broadcast in place
        ("nccl", 80 << 30, ("cuda", False, False)),  # fits: gathered on the GPU, broadcast from device memory
        ("nccl", 30 << 30, ("cpu", True, True)),  # a second copy would take over half the free memory
        ("nccl", None, ("cpu", True, True)),  # free memory unknown: never risk the GPU
    ],
)
def test_arena_placement_puts_buckets_on_the_gpu_only_for_nccl_and_only_when_they_fit(
    backend: str, free: int | None, expected: tuple[str, bool, bool]
) -> None:
    place = arena_placement(backend, 16 << 30, free)
    assert (place.device, place.pin_memory, place.staged) == expected
    with pytest.raises(ValueError, match=r"^backend: 'mpi'"):
        arena_placement("mpi", 1, None)


@pytest.mark.parametrize(
    ("backend", "free", "expected"),
    [("gloo", 0, ("cpu", False)), ("nccl", 80 << 30, ("cuda", False)), ("nccl", 1 << 10, ("cpu", True))],
)
def test_the_trainer_gathers_into_the_arena_the_placement_chooses(
    monkeypatch: pytest.MonkeyPatch, backend: str, free: int, expected: tuple[str, bool]
) -> None:
    """WeightPublisher.arena_for asks arena_placement with the GPU's free memory (NCCL only); the arena is
    made where it says (recorded here: this build has no GPU) and kept while the specs stay."""
    made: list[tuple[str, bool]] = []

    def record(layout: WeightManifest, device: str, *, pin_memory: bool) -> WeightArena:
        made.append((device, pin_memory))
        return WeightArena(layout)

    monkeypatch.setattr(sync, "WeightArena", record)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 2 * free))
    publisher = sync.WeightPublisher(WeightSyncConfig(backend=backend), controller=None, weights_dir="")
    assert publisher.arena_for(SPECS) is publisher.arena_for(SPECS)
    assert made == [expected]
    with pytest.raises(ValidationError, match="verify"):
        WeightSyncConfig(verify="md5")
