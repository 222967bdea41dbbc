"""The weights fingerprint: its formula (against a numpy reference), folding chunk by chunk as a transfer
lands, what it detects, the manifest's ``verify`` field and where trainer rank 0 keeps its arena."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from relayrl.bench.weightsync import random_tensors
from relayrl.config import WeightSyncConfig
from relayrl.trainer import sync
from relayrl.v1 import controller_pb2
from relayrl.weightsync import (
    Fingerprinter,
    WeightArena,
    WeightManifest,
    arena_placement,
    build_manifest,
    weights_checksum,
)
from relayrl.weightsync.checksum import ChecksumParts, manifest_checksum
from relayrl.weightsync.fingerprint import BLOCK, Sampling, manifest_fingerprint, phase_for, tensor_sums
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


def reference_sums(tensor: torch.Tensor, first_block: int = 0, stride: int = 1, phase: int = 0) -> tuple[int, int]:
    """s1, s2 of the module docstring, in numpy's uint64 (whose arithmetic wraps by definition), over the
    blocks k of the tensor with (first_block + k + phase) % stride == 0 (all of them by default)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % BLOCK)
    blocks = np.frombuffer(raw, dtype="<u8").reshape(-1, BLOCK // 8).sum(1, dtype=np.uint64)
    weights = np.arange(1, len(blocks) + 1, dtype=np.uint64)
    sampled = (first_block + np.arange(len(blocks)) + phase) % stride == 0
    blocks, weights = blocks[sampled], weights[sampled]
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


SAMPLED_SPECS = [*SPECS, ("large", (48, 512), torch.float32)]  # 96 KiB: 384 blocks, sampled at any stride below


def sampled_manifest(version: int, stride: int, bucket_bytes: int = 64 << 10) -> WeightManifest:
    manifest = build_manifest(SAMPLED_SPECS, version=version, bucket_bytes=bucket_bytes)
    return manifest.with_header(
        version=version, verify="sampled", sample_stride=stride, sample_phase=phase_for(version, stride)
    )


@pytest.mark.parametrize(("stride", "phase", "first_block"), [(1, 0, 0), (4, 3, 0), (4, 1, 7), (64, 17, 5)])
def test_sampled_sums_follow_the_formula_over_the_sampled_blocks(stride: int, phase: int, first_block: int) -> None:
    tensors = random_tensors(SAMPLED_SPECS)
    tensors["strided"] = tensors["big"].t()
    for name, tensor in tensors.items():
        got = tuple(int(v) % 2**64 for v in tensor_sums(tensor, Sampling(stride, phase), first_block).tolist())
        assert got == reference_sums(tensor, first_block, stride, phase), name


def fold_sampled(manifest: WeightManifest, arena: WeightArena, chunk_bytes: int, in_order: bool = False) -> str:
    """Chunks in order are folded in runs (a bucket at a time), out of order one by one."""
    chunks = [
        (b.index, c.start, flat[c.start : c.end])
        for b, flat in zip(manifest.buckets, arena.buckets, strict=True)
        for c in transfer_chunks(manifest, b, chunk_bytes)
    ]
    fold = Fingerprinter(manifest, chunk_bytes, "cpu")
    for bucket, start, data in chunks if in_order else reversed(chunks):
        fold.add(bucket, start, data)
    return fold.hexdigest()


@pytest.mark.parametrize("stride", [2, 8, 64])
@pytest.mark.parametrize("chunk_bytes", [256, 1024, 5120, 1 << 20])
def test_sampled_fold_equals_the_direct_value_on_the_same_tensors_for_any_chunking(
    stride: int, chunk_bytes: int
) -> None:
    """Sender and receivers fold chunks as they land (garbage in the padding); a worker that loads tensors
    itself computes the value from them (``manifest_checksum``, one tensor at a time: ``ChecksumParts``)."""
    tensors = random_tensors(SAMPLED_SPECS)
    for version in (1, 2, 3):
        manifest = sampled_manifest(version, stride)
        arena = arena_with_garbage_padding(manifest, tensors)
        direct = manifest_fingerprint(manifest, list(tensors.items()))
        parts = ChecksumParts.for_manifest(manifest)
        for name, tensor in tensors.items():
            parts.add(name, tensor)
        assert direct.startswith("fs:")
        assert fold_sampled(manifest, arena, chunk_bytes) == direct == parts.checksum()
        assert fold_sampled(manifest, arena, chunk_bytes, in_order=True) == direct
        assert direct == manifest_checksum(manifest, reversed(list(tensors.items())))
        assert direct != weights_checksum(tensors.items())  # not the full fingerprint, nor another phase's
        other = manifest.with_header(
            version=version, verify="sampled", sample_stride=stride, sample_phase=(manifest.sample_phase + 1) % stride
        )
        assert direct != manifest_fingerprint(other, list(tensors.items()))
    with pytest.raises(ValueError, match=r"^nope: not in the manifest"):
        manifest_fingerprint(manifest, [("nope", torch.zeros(1))])


def test_a_flipped_byte_is_caught_when_its_block_is_sampled_and_by_some_phase_otherwise() -> None:
    """In one update only the sampled blocks count (the documented miss: 1 - 1/stride for one flipped word);
    every block is sampled by one phase in ``stride``."""
    stride, tensors = 8, random_tensors(SAMPLED_SPECS)
    manifest = sampled_manifest(1, stride)
    spec = next(t for t in manifest.tensors if t.name == "large")
    caught_by = set()
    for phase in range(stride):
        header = manifest.with_header(version=1, verify="sampled", sample_stride=stride, sample_phase=phase)
        arena = arena_with_garbage_padding(header, tensors)
        base = fold_sampled(header, arena, 4096)
        for block in range(spec.offset // BLOCK, spec.offset // BLOCK + 2 * stride):
            arena.buckets[spec.bucket][block * BLOCK + 77] ^= 0x04
            sampled = (block + phase) % stride == 0
            assert (fold_sampled(header, arena, 4096) != base) == sampled, (phase, block)
            arena.buckets[spec.bucket][block * BLOCK + 77] ^= 0x04
            if sampled:
                caught_by.add(block % stride)
    assert caught_by == set(range(stride))


def test_a_zeroed_stale_or_misplaced_bucket_or_chunk_fails_the_sampled_fingerprint() -> None:
    """Every bucket (and chunk) of at least ``stride`` blocks holds a sampled block whatever the phase; a
    smaller one may hold none in a given update (the documented miss)."""
    stride, old, new = 8, random_tensors(SAMPLED_SPECS, seed=1), random_tensors(SAMPLED_SPECS, seed=2)
    manifest = sampled_manifest(5, stride, bucket_bytes=16 << 10)
    arena = arena_with_garbage_padding(manifest, new)
    base = fold_sampled(manifest, arena, stride * BLOCK)
    stale = arena_with_garbage_padding(manifest, old)
    checked = 0
    for index, bucket in enumerate(arena.buckets):
        if bucket.numel() < stride * BLOCK:
            continue
        checked += 1
        kept = bucket.clone()
        for fault in ("zeroed", "stale", "stale chunk", "shifted"):
            if fault == "zeroed":
                bucket.zero_()
            elif fault == "stale":
                bucket.copy_(stale.buckets[index])
            elif fault == "stale chunk":
                bucket[: stride * BLOCK] = stale.buckets[index][: stride * BLOCK]
            else:  # the bucket's bytes landed one block late
                bucket[BLOCK:] = kept[:-BLOCK].clone()
            if torch.equal(bucket, kept):
                continue
            assert fold_sampled(manifest, arena, stride * BLOCK) != base, (index, fault)
            bucket.copy_(kept)
    assert fold_sampled(manifest, arena, stride * BLOCK) == base and checked >= 3


def test_the_phase_changes_from_version_to_version_and_covers_every_block() -> None:
    phases = [phase_for(version, 64) for version in range(1, 1001)]
    assert set(phases) == set(range(64))
    assert sum(a != b for a, b in itertools.pairwise(phases)) > 900
    assert phase_for(7, 64) == phase_for(7, 64)  # a version re-sent (a joiner) samples the same blocks


def test_sampled_travels_in_the_manifest_with_its_stride_and_phase() -> None:
    manifest = sampled_manifest(3, 64)
    back = WeightManifest.from_proto(manifest.to_proto())
    assert (back.verify, back.sample_stride, back.sample_phase) == ("sampled", 64, phase_for(3, 64))
    for stride, phase, field in ((48, 0, "sample_stride"), (0, 0, "sample_stride"), (64, 64, "sample_phase")):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            manifest.with_header(version=4, verify="sampled", sample_stride=stride, sample_phase=phase)
    with pytest.raises(ValueError, match=r"^sample_stride: 64, sample_phase: 0 need verify 'sampled'"):
        manifest.with_header(version=4, verify="fingerprint", sample_stride=64)
    with pytest.raises(ValidationError, match="sample_stride"):
        WeightSyncConfig(sample_stride=48)


@pytest.mark.parametrize(
    ("verify", "transport", "header"),
    [
        ("sampled", "broadcast", {"verify": "sampled", "sample_stride": 16}),
        ("fingerprint", "broadcast", {"verify": "fingerprint", "sample_stride": 0}),
        ("sampled", "filesystem", {"verify": "", "checksum": "fp:"}),  # read back whole: the full fingerprint
        ("sha256", "broadcast", {"verify": ""}),
        ("off", "broadcast", {"verify": "off", "checksum": ""}),
    ],
)
def test_the_trainer_asks_for_the_configured_check_with_a_phase_per_version(
    verify: str, transport: str, header: dict
) -> None:
    cfg = WeightSyncConfig(verify=verify, transport=transport, sample_stride=16)
    publisher = sync.WeightPublisher(cfg, controller=None, weights_dir="")
    arena = publisher.arena_for(SPECS)
    arena.load(random_tensors(SPECS).items())
    manifests = [
        arena.manifest.with_header(version=v, transport=transport, **publisher._verification(v, arena)) for v in (1, 2)
    ]
    for manifest in manifests:
        for key, value in header.items():
            got = getattr(manifest, key)
            assert got.startswith(value) if key == "checksum" else got == value, key
    if verify == "sampled" and transport == "broadcast":
        assert [m.sample_phase for m in manifests] == [phase_for(1, 16), phase_for(2, 16)]
        assert phase_for(1, 16) != phase_for(2, 16)


class EmptyPlanController:
    """A controller with no registered rollout worker yet (a trainer that starts before its workers)."""

    def GetWeightSyncPlan(self, request, timeout: float):
        return controller_pb2.WeightSyncPlan()


@pytest.mark.parametrize(
    ("verify", "transport"), [("sampled", "broadcast"), ("sha256", "broadcast"), ("fingerprint", "filesystem")]
)
def test_a_publish_with_no_worker_to_update_reports_nothing_synced(verify: str, transport: str, tmp_path) -> None:
    """Nothing is sent, nothing fails; the recorded checksum is the out-of-band one where the manifest has
    it and empty where the check would have been folded in band (no transfer happened)."""
    cfg = WeightSyncConfig(verify=verify, transport=transport)
    publisher = sync.WeightPublisher(cfg, controller=EmptyPlanController(), weights_dir=str(tmp_path))
    arena = publisher.arena_for(SPECS)
    arena.load(random_tensors(SPECS).items())
    result = publisher.publish(0, arena)
    assert (result.version, result.synced, result.failed) == (0, [], {})
    expected = "" if verify == "sampled" else weights_checksum(arena.views(), method=verify)
    assert result.checksum == expected
