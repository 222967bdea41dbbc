"""Rollout-worker side of a weight update, two ways.

``receive_into``: the engine's weights live in a ``WeightArena`` with the manifest's layout, so every
chunk is received straight into the weights: no staging, no copy, no extra memory.

``receive_weights``: for engines that must be handed tensors (vLLM / SGLang ``load_weights``): the
buckets are received in order into two reusable buffers. While bucket k is received and loaded from
slot k % 2, every chunk of bucket k+1 is already posted into the other slot (whose bucket, k-1, is
fully loaded), so the extra memory is at most two buckets (``peak_extra_bytes``). ``load_fn`` is
called with views of the tensors a chunk completes, as soon as it arrives; it must copy them into
the engine's parameters before returning (the buffer is overwritten two buckets later).

Both fold every chunk into the update's fingerprint as it lands when the manifest asks for it
(``verify: fingerprint``; ``sampled``: its sampled blocks), compare it with the sender's (broadcast after
the last bucket) and vote the result: a mismatch raises ``WeightMismatch`` here and fails the sender's
send; ``ReceiveStats.checksum`` is the fingerprint of what landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from relayrl.weightsync.arena import WeightArena
from relayrl.weightsync.errors import WeightMismatch
from relayrl.weightsync.fingerprint import Fingerprinter, exchange, in_band
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.packing import BufferPair, Chunk, check_device, transfer_chunks, views
from relayrl.weightsync.stats import ReceiveStats

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
Progress = Callable[[int], None]


def receive_into(
    group: WeightBroadcastGroup,
    manifest: WeightManifest,
    arena: WeightArena,
    *,
    src: int = 0,
    progress: Progress | None = None,
) -> ReceiveStats:
    """Receive every bucket of ``manifest`` from rank ``src`` directly into ``arena`` (ValueError unless
    ``arena.fits(manifest)`` and it lives on the group's device); ``progress`` as in
    ``WeightArena.broadcast``. Ends with the collective vote, like ``receive_weights``."""
    if not arena.fits(manifest):
        raise ValueError(f"manifest: version {manifest.version} does not have the layout of the arena")
    start = time.perf_counter()
    fold = in_band(manifest, group)
    arena.broadcast(group, src, progress, fold)
    checksum = _verify(group, manifest, fold, src, None)
    return ReceiveStats(
        seconds=time.perf_counter() - start,
        nbytes=manifest.total_bytes,
        buckets=len(manifest.buckets),
        peak_extra_bytes=0,
        checksum=checksum,
    )


def _verify(
    group: WeightBroadcastGroup,
    manifest: WeightManifest,
    fold: Fingerprinter | None,
    src: int,
    failure: Exception | None,
) -> str:
    """The in-band comparison (when ``fold``) and the closing vote; raises ``failure`` (a load that failed)
    or WeightMismatch after voting, so that the group stays in step. Returns the fingerprint or ""."""
    checksum, same = exchange(group, fold, src) if fold is not None else ("", True)
    group.all_ok(failure is None and same)
    if failure is not None:
        raise failure
    if not same:
        raise WeightMismatch(f"checksum: the weights of version {manifest.version} that landed are not those sent")
    return checksum


def receive_weights(
    group: WeightBroadcastGroup,
    manifest: WeightManifest,
    load_fn: LoadFn,
    *,
    device: torch.device | str | None = None,
    src: int = 0,
    buffers: BufferPair | None = None,
) -> ReceiveStats:
    """Receive every bucket of ``manifest`` from rank ``src``; ``load_fn(views)`` sees every tensor once.

    The staging buffers live on ``device`` (default: the group's device), or are ``buffers`` (kept
    between updates by the caller; on the group's device). If ``load_fn`` raises, the
    remaining buckets are still received (the group stays in step), the failure is voted to the
    sender, and the exception is re-raised here.
    """
    buffers = buffers if buffers is not None else BufferPair(device if device is not None else group.device)
    check_device(buffers, group)
    start = time.perf_counter()
    buckets = manifest.buckets
    buffers.prepare(buckets)
    fold = in_band(manifest, group)

    def post(k: int) -> list[tuple[Chunk, torch.Tensor, dist.Work]]:
        """Start receiving every chunk of bucket k into slot k % 2."""
        flat = buffers.slot(k, buckets[k].nbytes)
        chunks = transfer_chunks(manifest, buckets[k], group.chunk_bytes)
        return [(c, flat, group.broadcast_async(flat[c.start : c.end], src=src)) for c in chunks]

    failure: Exception | None = None
    pending = post(0) if buckets else []
    for k in range(len(buckets)):
        current, pending = pending, post(k + 1) if k + 1 < len(buckets) else []
        for chunk, flat, work in current:
            group.wait(work)
            if fold is not None:
                fold.add(k, chunk.start, flat[chunk.start : chunk.end])
            if failure is None and chunk.complete:
                try:
                    load_fn(views(flat, chunk.complete))
                except Exception as exc:
                    failure = exc
    checksum = _verify(group, manifest, fold, src, failure)
    return ReceiveStats(
        seconds=time.perf_counter() - start,
        nbytes=manifest.total_bytes,
        buckets=len(buckets),
        peak_extra_bytes=buffers.nbytes,
        checksum=checksum,
    )
