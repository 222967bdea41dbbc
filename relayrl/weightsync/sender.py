"""Trainer rank 0 side of a weight update: pack and broadcast the manifest's buckets, double-buffered.

From a ``WeightArena`` with the manifest's layout on the group's device (where the trainer gathers its
weights), the buckets go out as they are: nothing to pack. Otherwise bucket k is staged into slot
k % 2 while bucket k-1 (the other slot) is still being broadcast; before a slot is reused, the
broadcasts that last read it are waited for (each wait bounded by the group's timeout). Inside a
bucket, chunk c is broadcast as soon as it is staged, so staging chunk c+1 overlaps sending chunk c.
Staging a chunk is one copy from an arena elsewhere (a pinned CPU arena feeding NCCL: one
host-to-device copy per chunk), or one ``_foreach_copy_`` of its tensors from a mapping. The update
ends with a collective vote: ``send`` returns only once every receiver has loaded every tensor, and
raises WeightSyncError if any failed to. When the manifest asks for it (``verify: fingerprint`` or
``sampled``), every chunk is fingerprinted (sampled: its sampled blocks) as it goes out and the fingerprint
is broadcast after the last bucket, before the vote (see ``relayrl.weightsync.fingerprint``);
``SendStats.checksum`` is that fingerprint.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from relayrl.weightsync.arena import WeightArena
from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.fingerprint import Fingerprinter, exchange, in_band
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.packing import BufferPair, PackStep, check_device, pack_plan
from relayrl.weightsync.stats import SendStats


class WeightSender:
    """Owns the two staging buffers (kept between updates) on ``device``; pinned when asked (CPU only)."""

    def __init__(self, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> None:
        self.buffers = BufferPair(device, pin_memory=pin_memory)
        self._plan: tuple[tuple, list[list[PackStep]]] | None = None  # (layout, chunk, slots) -> its plan

    def send(
        self,
        group: WeightBroadcastGroup,
        manifest: WeightManifest,
        tensors: Mapping[str, torch.Tensor] | WeightArena,
    ) -> SendStats:
        """Broadcast every bucket of ``manifest`` from this rank; ``tensors`` maps name -> tensor, or is
        an arena (sent in place when it fits the manifest and lives on the group's device).

        Checks ``tensors`` against the manifest before the first byte goes out (ValueError naming the
        tensor), so receivers never see a half-sent update because of a sender-side mistake.
        """
        start = time.perf_counter()
        fold = in_band(manifest, group)
        arena = tensors if isinstance(tensors, WeightArena) and tensors.fits(manifest) else None
        if arena is not None and arena.device.type == group.device.type:
            arena.broadcast(group, group.rank, fold=fold)
            return self._finish(group, manifest, start, 0, fold)
        if arena is None:
            tensors = dict(tensors.views()) if isinstance(tensors, WeightArena) else tensors
            manifest.validate_against([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
        check_device(self.buffers, group)
        in_flight: list[list[dist.Work]] = [[], []]  # per slot: the chunk broadcasts still reading it
        for k, steps in enumerate(self._plan_for(manifest, group.chunk_bytes)):
            for work in in_flight[k % 2]:
                group.wait(work)
            in_flight[k % 2] = []
            for step in steps:
                with torch.no_grad():
                    if arena is not None:
                        step.piece.copy_(arena.buckets[k][step.start : step.end], non_blocking=True)
                    elif step.names:  # one dispatch for the chunk's copies (FSDP2 packs the same way)
                        torch._foreach_copy_(step.targets, [tensors[name] for name in step.names])
                in_flight[k % 2].append(group.broadcast_async(step.piece, src=group.rank))
                if fold is not None:  # the staged bytes, as they go out (on the group's device)
                    fold.add(k, step.start, step.piece)
        for work in in_flight[0] + in_flight[1]:
            group.wait(work)
        return self._finish(group, manifest, start, self.buffers.nbytes, fold)

    @staticmethod
    def _finish(
        group: WeightBroadcastGroup,
        manifest: WeightManifest,
        start: float,
        peak_extra_bytes: int,
        fold: Fingerprinter | None,
    ) -> SendStats:
        """The fingerprint (in band), then the closing vote: WeightSyncError unless every receiver loaded
        every tensor and holds the bytes that were sent."""
        checksum = exchange(group, fold, group.rank)[0] if fold is not None else ""
        if not group.all_ok(True):
            raise WeightSyncError(
                f"a receiver failed to load weights version {manifest.version} or holds other bytes than were sent"
            )
        return SendStats(
            seconds=time.perf_counter() - start,
            nbytes=manifest.total_bytes,
            buckets=len(manifest.buckets),
            peak_extra_bytes=peak_extra_bytes,
            checksum=checksum,
        )

    def _plan_for(self, manifest: WeightManifest, chunk_bytes: int) -> list[list[PackStep]]:
        """The pack plan of this layout, built once and reused while layout, chunking and slots stay."""
        self.buffers.prepare(manifest.buckets)
        key = (manifest.layout_id, chunk_bytes, self.buffers.identity)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, pack_plan(manifest, self.buffers, chunk_bytes))
        return self._plan[1]
