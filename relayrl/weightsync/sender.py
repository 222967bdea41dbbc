"""Trainer rank 0 side of a weight update: pack and broadcast the manifest's buckets, double-buffered.

Bucket k is packed into slot k % 2 while bucket k-1 (the other slot) is still being broadcast; before
a slot is reused, the broadcasts that last read it are waited for (each wait bounded by the group's
timeout). Inside a bucket, chunk c is broadcast as soon as the tensors it holds are packed, so
packing chunk c+1 overlaps sending chunk c. The update ends with a collective vote: ``send`` returns
only once every receiver has loaded every tensor, and raises WeightSyncError if any failed to.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.packing import BufferPair, check_device, pack_tensors, transfer_chunks
from relayrl.weightsync.stats import SendStats


class WeightSender:
    """Owns the two staging buffers (kept between updates) on ``device``; pinned when asked (CPU only)."""

    def __init__(self, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> None:
        self.buffers = BufferPair(device, pin_memory=pin_memory)

    def send(
        self, group: WeightBroadcastGroup, manifest: WeightManifest, tensors: Mapping[str, torch.Tensor]
    ) -> SendStats:
        """Broadcast every bucket of ``manifest`` from this rank; ``tensors`` maps name -> tensor.

        Checks ``tensors`` against the manifest before the first byte goes out (ValueError naming the
        tensor), so receivers never see a half-sent update because of a sender-side mistake.
        """
        manifest.validate_against([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
        check_device(self.buffers, group)
        start = time.perf_counter()
        self.buffers.prepare(manifest.buckets)
        in_flight: list[list[dist.Work]] = [[], []]  # per slot: the chunk broadcasts still reading it
        for k, bucket in enumerate(manifest.buckets):
            for work in in_flight[k % 2]:
                group.wait(work)
            flat = self.buffers.slot(k, bucket.nbytes)
            in_flight[k % 2] = []
            for chunk in transfer_chunks(manifest, bucket, group.chunk_bytes):
                pack_tensors(flat, chunk.to_pack, tensors)
                in_flight[k % 2].append(group.broadcast_async(flat[chunk.start : chunk.end], src=group.rank))
        for work in in_flight[0] + in_flight[1]:
            group.wait(work)
        if not group.all_ok(True):
            raise WeightSyncError(f"a receiver failed to load weights version {manifest.version}")
        return SendStats(
            seconds=time.perf_counter() - start,
            nbytes=manifest.total_bytes,
            buckets=len(manifest.buckets),
            peak_extra_bytes=self.buffers.nbytes,
        )
