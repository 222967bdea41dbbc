"""A fingerprint of named weights cheap enough for every update, computed where the bytes are.

Per tensor (its bytes in row-major order, zero-padded to a multiple of ``BLOCK`` = 256 bytes, read as
little-endian int64 words w, 32 words per block b):

    r_b = sum_{j<32} w_{32b+j}        s1 = sum_b r_b        s2 = sum_b (b + 1) * r_b      (all mod 2**64)

    fingerprint = "fp:" + sha256(for each tensor in name order: name \\0 dtype \\0 shape \\0 || s1 s2 as int64 LE)

Integer sums modulo 2**64 (torch's int64 arithmetic wraps) do not depend on the order of the additions, so
the value is the same on any device, with any number of threads, computed per tensor or folded chunk by
chunk as a transfer lands (``Fingerprinter``). What it catches: any change of one 8-byte word, so every
flipped byte or bit (exactly: the sum moves by a non-zero amount below 2**64); a stale, torn, zeroed or
misplaced 256-byte block (s1 and the position-weighted s2, up to a chance of about 2**-64 for unrelated
data); a tensor's bytes under another name, dtype or shape. What it does not: a permutation of words
inside one 256-byte block, or deliberate forgery (use ``weight_sync.verify: sha256`` for that). Cost: one
read of the bytes (at memory speed where they are, HBM on a GPU), no copy except of tensors that are not
contiguous.

A ``Fingerprinter`` needs every tensor of the manifest at a ``BLOCK``-aligned offset (what
``build_manifest`` lays out) and chunks that start at multiples of ``BLOCK``.

Sampled (``Sampling(stride, phase)``, ``verify: sampled``): the same sums over only the blocks b of a bucket
with (b + phase) % stride == 0 (b counted from the bucket's start; stride a power of two), each at its
tensor-relative weight, and

    sampled fingerprint = "fs:" + sha256("sampled" \\0 stride \\0 phase \\0 || the records and sums above)

Folding reads only those blocks (a strided view of each chunk): 1/stride of the bytes. The phase changes
from version to version (``phase_for``), so successive updates check every block in turn. What it catches
at once: anything that changes a sampled block. Every ``stride`` consecutive blocks hold one (16 KiB at
stride 64), so a wrong, stale, zeroed, torn or misplaced chunk or bucket of at least that size is caught in
the update it happens in, and so is a tensor's wrong name, dtype or shape (the records are hashed whole).
What it can miss in one update: a change confined to blocks outside the sample: a single flipped word with
probability 1 - 1/stride, a fault confined to a tensor (or bucket) of k < stride blocks with probability
1 - k/stride; the update whose phase samples those blocks catches it. Stride 1 is the full fingerprint
with the "fs:" prefix.

In band (``manifest.verify`` "fingerprint" or "sampled" over a broadcast): sender and receivers fold every
chunk right after it went out / landed, while the next ones are on the wire; after the last bucket the
sender broadcasts its 32-byte digest (``exchange``), each receiver compares it with its own, and the
closing vote carries the result. No value has to be known before the transfer starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from relayrl.weightsync.manifest import ALIGN, IN_BAND, TensorSpec, WeightManifest, dtype_name

if TYPE_CHECKING:
    from relayrl.weightsync.group import WeightBroadcastGroup

BLOCK = 256
WORDS = BLOCK // 8
PREFIX = "fp:"
SAMPLED_PREFIX = "fs:"
DIGEST_BYTES = 32
assert ALIGN % BLOCK == 0, "manifest offsets must be block-aligned"


@dataclass(frozen=True)
class Sampling:
    """Which blocks are read: b with (b + phase) % stride == 0, b counted from the start of the bucket
    (``first_block`` below: the block a tensor or chunk starts at). ``FULL`` (stride 1) reads every block."""

    stride: int = 1
    phase: int = 0

    def skip(self, first_block: int) -> int:
        """Blocks to skip from ``first_block`` to the first sampled one: (-(first_block + phase)) % stride."""
        return -(first_block + self.phase) % self.stride

    @property
    def prefix(self) -> str:
        return PREFIX if self == FULL else SAMPLED_PREFIX

    @property
    def header(self) -> bytes:
        """What the digest hashes first: nothing for the full fingerprint, the rule for a sampled one."""
        return b"" if self == FULL else f"sampled\0{self.stride}\0{self.phase}\0".encode()

    @classmethod
    def of(cls, manifest: WeightManifest) -> Sampling:
        """The manifest's rule: its stride and phase under ``verify: sampled``, else FULL."""
        return cls(manifest.sample_stride, manifest.sample_phase) if manifest.verify == "sampled" else FULL


FULL = Sampling()


def phase_for(version: int, stride: int) -> int:
    """The sampled phase of update ``version``: sha256 of the version, mod ``stride``. Successive versions
    draw unrelated phases (no version-parity pattern a periodic fault could hide in); re-sending one version
    (a joining worker, a resumed trainer) samples the same blocks, so a version has one checksum."""
    return int.from_bytes(hashlib.sha256(version.to_bytes(8, "little", signed=True)).digest()[:8], "little") % stride


def _block_sums(data: torch.Tensor, skip: int = 0, stride: int = 1) -> torch.Tensor:
    """r_b over whole blocks skip, skip + stride, ... of the flat uint8 ``data`` (len a multiple of BLOCK),
    as int64; a strided view, so only those blocks are read."""
    if data.storage_offset() % 8:  # int64 words need an 8-byte aligned start
        data = data.clone()
    return data.view(torch.int64).view(-1, WORDS)[skip::stride].sum(1)


def _padded_block_sum(data: torch.Tensor) -> torch.Tensor:
    """r of the bytes of ``data`` (< BLOCK of them) zero-padded to one block (a 0-d int64 tensor)."""
    block = torch.zeros(BLOCK, dtype=torch.uint8, device=data.device)
    block[: data.numel()] = data
    return block.view(torch.int64).sum()


def tensor_sums(tensor: torch.Tensor, sampling: Sampling = FULL, first_block: int = 0) -> torch.Tensor:
    """(s1, s2) of one tensor that starts at block ``first_block`` of its bucket, over the blocks ``sampling``
    reads (weights tensor-relative: block k of the tensor counts k + 1), an int64 tensor of shape (2,) on the
    tensor's device."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = flat.numel() // BLOCK
    skip, stride = sampling.skip(first_block), sampling.stride
    r = _block_sums(flat[: whole * BLOCK], skip, stride)
    if whole * BLOCK < flat.numel() and whole >= skip and (whole - skip) % stride == 0:
        r = torch.cat([r, _padded_block_sum(flat[whole * BLOCK :]).reshape(1)])
    weights = torch.arange(skip + 1, skip + 1 + stride * r.numel(), stride, dtype=torch.int64, device=r.device)
    return torch.stack([r.sum(), (r * weights).sum()])


Records = Sequence[tuple[str, torch.dtype, Sequence[int]]]


def encode_records(records: Records) -> tuple[list[int], list[bytes]]:
    """(name order, name \\0 dtype \\0 shape \\0 of each record): what ``digest`` hashes besides the sums."""
    order = sorted(range(len(records)), key=lambda k: records[k][0])
    return order, [f"{name}\0{dtype_name(dtype)}\0{list(shape)}\0".encode() for name, dtype, shape in records]


def digest(
    records: Records,
    sums: torch.Tensor,
    sampling: Sampling = FULL,
    encoded: tuple[list[int], list[bytes]] | None = None,
) -> bytes:
    """The sha256 above over ``records`` (name, dtype, shape) and their ``sums`` (n x 2 int64, any device);
    ``encoded``: ``encode_records(records)``, when kept from an earlier update of the same layout."""
    order, texts = encoded or encode_records(records)
    values = sums.to("cpu").numpy().astype("<i8")
    h = hashlib.sha256(sampling.header)
    h.update(b"".join(texts[i] + values[i].tobytes() for i in order))
    return h.digest()


def as_text(raw: bytes, sampling: Sampling = FULL) -> str:
    """A digest's checksum string: "fp:" + hex ("fs:" + hex when sampled)."""
    return sampling.prefix + raw.hex()


def fingerprint(
    named: Sequence[tuple[str, torch.Tensor]],
    sampling: Sampling = FULL,
    first_blocks: Mapping[str, int] | None = None,
) -> str:
    """The fingerprint of (name, tensor) pairs (names unique), each summed on its own device; sampled:
    ``first_blocks`` names the block each tensor starts at in its bucket (``manifest_fingerprint``)."""
    if sampling != FULL and first_blocks is None:
        raise ValueError("first_blocks: a sampled fingerprint needs each tensor's place in its bucket")
    if not named:
        return as_text(digest([], torch.zeros(0, 2, dtype=torch.int64), sampling), sampling)
    sums = [tensor_sums(t, sampling, first_blocks[name] if first_blocks else 0) for name, t in named]
    device = sums[0].device
    stacked = torch.stack([s.to(device) for s in sums])
    return as_text(digest([(name, t.dtype, tuple(t.shape)) for name, t in named], stacked, sampling), sampling)


def manifest_fingerprint(manifest: WeightManifest, named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """What folding an in-band update of ``manifest`` gives for tensors ``named``, computed directly from them:
    the sampled fingerprint at the manifest's places, stride and phase (``verify: sampled``), else the full
    one. ValueError for a name the manifest does not have."""
    places = {t.name: t.offset // BLOCK for t in manifest.tensors}
    unknown = next((name for name, _ in named if name not in places), None)
    if unknown is not None:
        raise ValueError(f"{unknown}: not in the manifest (version {manifest.version})")
    return fingerprint(named, Sampling.of(manifest), places)


def check_foldable(manifest: WeightManifest, chunk_bytes: int) -> None:
    """ValueError unless ``Fingerprinter`` can fold ``manifest``'s chunks (aligned tensors and chunks)."""
    if chunk_bytes % BLOCK:
        raise ValueError(f"chunk_bytes: {chunk_bytes} is not a multiple of {BLOCK}")
    for spec in manifest.tensors:
        if spec.offset % BLOCK:
            raise ValueError(f"{spec.name}: offset {spec.offset} is not a multiple of {BLOCK} (fingerprint)")


@dataclass
class _ChunkPlan:
    """Where the tensors of one chunk lie, in blocks relative to its start (see ``Fingerprinter.add``)."""

    first_block: int  # the chunk's first block within its bucket
    blocks: int  # ceil(chunk bytes / BLOCK)
    ids: torch.Tensor  # tensors with bytes in this chunk (manifest index)
    starts: torch.Tensor  # their first block here
    ends: torch.Tensor  # one past their last block here
    tails: torch.Tensor  # whole blocks here that end a tensor with padding after it
    tail_blocks: list[int]  # the same, in host memory
    padding: torch.Tensor  # (tails, BLOCK) uint8: 0 on the tensor's bytes, 1 on the padding after them
    last_tail: int  # bytes of a tensor in the chunk's final partial block (0: none)


def _plan(manifest: WeightManifest, chunk_bytes: int, device: torch.device) -> dict[tuple[int, int], _ChunkPlan]:
    """(bucket, chunk start) -> _ChunkPlan for every chunk ``transfer_chunks`` makes."""
    index = {spec.name: i for i, spec in enumerate(manifest.tensors)}
    plans = {}
    for bucket in manifest.buckets:
        specs = [s for s in manifest.bucket_tensors(bucket.index) if s.nbytes]
        for start in range(0, max(bucket.nbytes, 1), chunk_bytes):
            end = min(start + chunk_bytes, bucket.nbytes)
            plans[(bucket.index, start)] = _chunk_plan(specs, index, start, end, device)
    return plans


def _chunk_plan(specs: list[TensorSpec], index: dict[str, int], start: int, end: int, device) -> _ChunkPlan:
    first, blocks, whole = start // BLOCK, -(-(end - start) // BLOCK), (end - start) // BLOCK
    ids, starts, ends, tails, padding, last_tail = [], [], [], [], [], 0
    for spec in specs:
        lo, hi = spec.offset // BLOCK, -(-(spec.offset + spec.nbytes) // BLOCK)
        if hi <= first or lo >= first + blocks:
            continue
        ids.append(index[spec.name])
        starts.append(max(lo, first) - first)
        ends.append(min(hi, first + blocks) - first)
        valid = spec.nbytes % BLOCK
        if valid and first <= hi - 1 < first + blocks:
            if hi - 1 - first < whole:
                tails.append(hi - 1 - first)
                padding.append([0] * valid + [1] * (BLOCK - valid))
            else:
                last_tail = valid

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return _ChunkPlan(
        first,
        blocks,
        longs(ids),
        longs(starts),
        longs(ends),
        longs(tails),
        tails,
        torch.tensor(padding, dtype=torch.uint8, device=device).reshape(-1, BLOCK),
        last_tail,
    )


_PLANS: dict[tuple[str, int, str], tuple[dict[tuple[int, int], _ChunkPlan], tuple[list[int], list[bytes]]]] = {}


class Fingerprinter:
    """Folds one update's chunks, as they land, into ``fingerprint`` of the manifest's tensors (sampled as
    the manifest says: ``Sampling.of``).

    ``add(bucket, start, data)`` once per chunk of ``transfer_chunks(manifest, bucket, chunk_bytes)``, in any
    order, ``data`` being those bytes of the bucket (padding included; it is masked out); then
    ``hexdigest()`` equals ``manifest_fingerprint`` of the tensors those bytes hold. Only the sampled blocks
    of a chunk are read. The plan of a layout is built once per (layout, chunk size, device) and kept (the
    last few); it does not depend on the phase.

    Sampled, successive chunks that continue each other in one buffer are folded together, at the latest
    when the run reaches the end of its bucket (so a staging slot may be reused once its bucket's last chunk
    was added): a chunk's sampled blocks cost a few microseconds to read, its fold's dozen small tensor ops
    more, once per chunk.
    """

    def __init__(self, manifest: WeightManifest, chunk_bytes: int, device: torch.device | str) -> None:
        check_foldable(manifest, chunk_bytes)
        self.manifest = manifest
        self.sampling = Sampling.of(manifest)
        self.device = torch.device(device)
        key = (manifest.layout_id, chunk_bytes, str(self.device))
        if key not in _PLANS:
            while len(_PLANS) >= 4:
                _PLANS.pop(next(iter(_PLANS)))
            records = [(s.name, s.dtype, s.shape) for s in manifest.tensors]
            _PLANS[key] = _plan(manifest, chunk_bytes, self.device), encode_records(records)
        self._plans, self._records = _PLANS[key]
        self._acc = torch.zeros(len(manifest.tensors), 2, dtype=torch.int64, device=self.device)
        self._weights = torch.arange(1, -(-chunk_bytes // BLOCK) + 1, dtype=torch.int64, device=self.device)
        self._run: tuple[int, int, torch.Tensor] | None = None  # sampled: (bucket, start, bytes) not yet folded

    def add(self, bucket: int, start: int, data: torch.Tensor) -> None:
        if (bucket, start) not in self._plans:
            raise KeyError(f"chunk: bucket {bucket} has no chunk at {start}")
        if self.sampling == FULL:
            self._fold(self._plans[(bucket, start)], data)
            return
        run = self._run
        if run is not None and run[0] == bucket and _continues(run[2], data) and run[1] + run[2].numel() == start:
            self._run = (bucket, run[1], _joined(run[2], data))
        else:
            self._flush()
            self._run = (bucket, start, data)
        if start + data.numel() >= self.manifest.buckets[bucket].nbytes:
            self._flush()

    def _flush(self) -> None:
        """Fold the pending run of chunks (sampled) with the plan of its span, made once per layout."""
        if self._run is None:
            return
        bucket, start, data = self._run
        self._run = None
        key = (bucket, start, start + data.numel())
        plan = self._plans.get(key)
        if plan is None:
            index = {spec.name: i for i, spec in enumerate(self.manifest.tensors)}
            specs = [t for t in self.manifest.bucket_tensors(bucket) if t.nbytes]
            plan = self._plans[key] = _chunk_plan(specs, index, key[1], key[2], self.device)  # type: ignore[index]
        self._fold(plan, data)

    def _fold(self, plan: _ChunkPlan, data: torch.Tensor) -> None:
        """Fold the sampled blocks of one chunk: rows i = 0, 1, ... are its blocks skip + i * stride."""
        if not plan.ids.numel():
            return
        stride, skip = self.sampling.stride, self.sampling.skip(plan.first_block)
        whole = data.numel() // BLOCK
        rows = _block_sums(data[: whole * BLOCK], skip, stride)
        tails, padding = self._sampled_tails(plan, skip)
        if tails.numel():  # a sampled block that ends a tensor: minus the sum of its padding
            pad = data[: whole * BLOCK].view(-1, BLOCK).index_select(0, tails).mul_(padding).view(torch.int64)
            rows.index_add_(0, tails if stride == 1 else (tails - skip) // stride, pad.sum(1).neg_())
        if plan.blocks > whole and whole >= skip and (whole - skip) % stride == 0:
            last = _padded_block_sum(data[whole * BLOCK : whole * BLOCK + plan.last_tail])
            rows = torch.cat([rows, last.reshape(1)])
        if not rows.numel():  # no sampled block in this chunk
            return
        prefix = torch.empty(2, rows.numel() + 1, dtype=torch.int64, device=self.device)
        prefix[:, 0] = 0
        torch.cumsum(rows, 0, out=prefix[0, 1:])
        weights = (
            self._weights[: plan.blocks]
            if stride == 1
            else torch.arange(skip + 1, plan.blocks + 1, stride, dtype=torch.int64, device=self.device)
        )
        torch.cumsum(rows.mul_(weights), 0, out=prefix[1, 1:])
        starts, ends = plan.starts, plan.ends
        if stride > 1:  # rows before local block x: ceil((x - skip) / stride), never negative as skip < stride
            starts, ends = (starts + (stride - 1 - skip)) // stride, (ends + (stride - 1 - skip)) // stride
        segments = prefix[:, ends] - prefix[:, starts]  # sum r, sum (local b + 1) r
        segments[1] += plan.first_block * segments[0]  # bucket-relative: sum (b + 1) r
        self._acc.index_add_(0, plan.ids, segments.t())

    def _sampled_tails(self, plan: _ChunkPlan, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's tail blocks that are sampled (every one at stride 1), and their padding masks."""
        stride = self.sampling.stride
        if stride == 1:
            return plan.tails, plan.padding
        picked = [i for i, block in enumerate(plan.tail_blocks) if block >= skip and (block - skip) % stride == 0]
        if len(picked) == len(plan.tail_blocks):
            return plan.tails, plan.padding
        index = torch.tensor(picked, dtype=torch.int64, device=self.device)
        return plan.tails[index], plan.padding[index]

    def digest(self) -> bytes:
        """The fingerprint's 32 raw bytes (what the sender broadcasts after the buckets)."""
        self._flush()
        first_blocks = torch.tensor([s.offset // BLOCK for s in self.manifest.tensors], device=self.device)
        s1, weighted = self._acc[:, 0], self._acc[:, 1]
        sums = torch.stack([s1, weighted - first_blocks * s1], dim=1)  # bucket-relative -> tensor-relative
        return digest([(s.name, s.dtype, s.shape) for s in self.manifest.tensors], sums, self.sampling, self._records)

    def hexdigest(self) -> str:
        return as_text(self.digest(), self.sampling)


def _continues(first: torch.Tensor, then: torch.Tensor) -> bool:
    """Whether flat ``then`` starts where flat ``first`` ends, in the same storage."""
    return (
        first.untyped_storage().data_ptr() == then.untyped_storage().data_ptr()
        and first.data_ptr() + first.numel() == then.data_ptr()
    )


def _joined(first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """One flat view over ``first`` and ``then`` (``_continues(first, then)``)."""
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (first.numel() + then.numel(),))


def in_band(manifest: WeightManifest, group: WeightBroadcastGroup) -> Fingerprinter | None:
    """The Fingerprinter of an update whose manifest asks for in-band verification, else None."""
    if manifest.verify not in IN_BAND or manifest.transport != "broadcast":
        return None
    return Fingerprinter(manifest, group.chunk_bytes, group.device)


def exchange(group: WeightBroadcastGroup, fold: Fingerprinter, src: int) -> tuple[str, bool]:
    """After the last bucket: rank ``src`` broadcasts its digest, every rank compares it with its own.
    Returns (this rank's fingerprint, whether it equals the sender's)."""
    mine = fold.digest()
    theirs = torch.tensor(list(mine), dtype=torch.uint8, device=group.device)
    group.broadcast(theirs, src=src)
    return as_text(mine, fold.sampling), bytes(theirs.to("cpu").tolist()) == mine
