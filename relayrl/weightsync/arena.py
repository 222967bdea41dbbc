"""Weights stored in a manifest's layout, so that an update is received in place (zero-copy).

A ``WeightArena`` holds one flat uint8 tensor per bucket of a manifest; tensor ``spec`` is the view
``buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes]`` as its dtype and shape. Once an
engine's parameters *are* these views (``point``), a broadcast of the manifest's buckets writes
straight into the weights: no staging buffer, no unpack copy, no extra memory.

``adopt`` moves live parameters into a new arena one bucket at a time (allocate the bucket, copy its
tensors in, re-point them, let their old storage go), so the peak extra memory of the move is one
bucket, not one model.

``arena_placement`` decides where trainer rank 0 keeps the arena its weights are gathered into.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from relayrl.weightsync.fingerprint import Fingerprinter
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest
from relayrl.weightsync.packing import tensor_view, transfer_chunks

DEVICE_ARENA_BUDGET = 0.5  # at most this share of the GPU's free memory goes to a device arena


@dataclass(frozen=True)
class Placement:
    """Where an arena lives (``device``, ``pin_memory``) and whether its buckets reach the group through
    staging buffers on the group's device (``staged``: one host-to-device copy per chunk) or in place."""

    device: str
    pin_memory: bool
    staged: bool


def arena_placement(
    backend: str, nbytes: int, device_free_bytes: int | None, budget: float = DEVICE_ARENA_BUDGET
) -> Placement:
    """The arena trainer rank 0 gathers ``nbytes`` of weights into, for a weight group on ``backend``:

    - gloo: host memory, broadcast in place;
    - nccl, when ``nbytes <= budget * device_free_bytes``: GPU memory; the gather is a device-to-device copy
      and the buckets are broadcast from device memory in place (no host round trip);
    - nccl otherwise (``device_free_bytes`` None: unknown), e.g. a model too large for a second copy on
      rank 0's GPU: pinned host memory, each chunk copied into a device staging buffer while the previous
      one is on the wire (the sender's double buffers: two chunks of device memory).
    """
    if backend == "gloo":
        return Placement("cpu", pin_memory=False, staged=False)
    if backend != "nccl":
        raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
    if device_free_bytes is not None and nbytes <= budget * device_free_bytes:
        return Placement("cuda", pin_memory=False, staged=False)
    return Placement("cpu", pin_memory=True, staged=True)


def same_layout(a: WeightManifest, b: WeightManifest) -> bool:
    """True iff ``a`` and ``b`` place the same tensors at the same bytes (versions may differ)."""
    return a.tensors is b.tensors or a.layout_id == b.layout_id


class WeightArena:
    """The buckets of ``manifest`` on ``device`` (pinned when asked, CPU only); ``nbytes``: memory held."""

    def __init__(
        self,
        manifest: WeightManifest,
        device: torch.device | str = "cpu",
        *,
        allocate: bool = True,
        pin_memory: bool = False,
    ) -> None:
        self.manifest = manifest
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self.buckets: list[torch.Tensor] = []
        self._views: dict[str, torch.Tensor] | None = None  # built once: the buckets never move
        if allocate:
            self.buckets = [self._new_bucket(b.nbytes) for b in manifest.buckets]

    @classmethod
    def adopt(
        cls, manifest: WeightManifest, params: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"
    ) -> WeightArena:
        """An arena holding the current values of ``params``, which now view it (see the module doc).

        ``params`` must hold every tensor of the manifest with its shape and dtype (ValueError naming
        the first that does not); their ``.data`` is replaced, so pass the live parameters.
        """
        manifest.validate_against([(name, tuple(p.shape), p.dtype) for name, p in params.items()])
        arena = cls(manifest, device, allocate=False)
        with torch.no_grad():
            for bucket in manifest.buckets:
                arena.buckets.append(arena._new_bucket(bucket.nbytes))
                for spec in manifest.bucket_tensors(bucket.index):
                    view = tensor_view(arena.buckets[-1], spec)
                    view.copy_(params[spec.name])
                    params[spec.name].data = view
        return arena

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buckets)

    def fits(self, manifest: WeightManifest) -> bool:
        """Whether ``manifest``'s buckets can be received straight into this arena."""
        return same_layout(self.manifest, manifest)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) for every tensor, in manifest order."""
        return list(self._view_map().items())

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor) into its view (a ``LoadFn`` for transports that hand out tensors)."""
        views = self._view_map()
        for name, tensor in named:
            if name not in views:
                raise ValueError(f"{name}: not in this arena's manifest")
            views[name].copy_(tensor)

    def point(self, params: Mapping[str, torch.Tensor]) -> None:
        """Make every parameter of the manifest view this arena (O(1) per tensor: ``.data`` swaps)."""
        for name, view in self.views():
            params[name].data = view

    def broadcast(
        self,
        group: WeightBroadcastGroup,
        src: int,
        progress: Callable[[int], None] | None = None,
        fold: Fingerprinter | None = None,
    ) -> None:
        """Every bucket over ``group`` in place, chunk by chunk (``transfer_chunks``): rank ``src`` sends
        its arena, the others receive into theirs. All chunks are posted at once (the backend runs them
        in order); as each completes it is folded into ``fold`` (while the next ones are on the wire)
        and ``progress(bytes so far)`` is called."""
        if self.device.type != group.device.type:
            raise ValueError(f"device: arena on {self.device}, the weight group runs on {group.device}")
        posted = [
            (bucket.index, chunk.start, flat[chunk.start : chunk.end])
            for bucket, flat in zip(self.manifest.buckets, self.buckets)
            for chunk in transfer_chunks(self.manifest, bucket, group.chunk_bytes)
        ]
        works = [group.broadcast_async(piece, src=src) for _, _, piece in posted]
        done = 0
        for (bucket, start, piece), work in zip(posted, works):
            group.wait(work)
            if fold is not None:
                fold.add(bucket, start, piece)
            done += piece.numel()
            if progress is not None:
                progress(done)

    def _view_map(self) -> dict[str, torch.Tensor]:
        """name -> view, built on first use (per-update callers would otherwise slice one view per tensor each
        time)."""
        if self._views is None:
            self._views = {spec.name: tensor_view(self.buckets[spec.bucket], spec) for spec in self.manifest.tensors}
        return self._views

    def _new_bucket(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)
