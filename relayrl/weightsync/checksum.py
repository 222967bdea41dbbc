"""Checksums of named weights, for checking that trainer and workers hold the same bytes. Two methods:

``fingerprint`` (see ``relayrl.weightsync.fingerprint``): "fp:" + hex, integer sums computed on the
tensors' own device at memory speed, and folded chunk by chunk while an update lands. Its sampled form
("fs:" + hex, ``verify: sampled``) depends on the update's manifest (places, stride, phase):
``manifest_checksum`` computes what a receiver of a manifest reports.

``sha256``: bare hex,

    tensor(t) = sha256(name \\0 dtype \\0 shape \\0 || bytes of t viewed as uint8)
    checksum  = sha256(tensor(t) for t in sorted name order)

hashed on a thread pool (hashlib releases the GIL on large buffers; a tensor that is not on the CPU is
copied there by its own task, so at most ``threads`` such copies exist at once): up to ``threads`` x one
core's sha256 speed, bounded below by the largest tensor.

A checksum string names its method (``checksum_method``), so a receiver checks by the sender's rule.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from relayrl.weightsync.fingerprint import (
    BLOCK,
    FULL,
    PREFIX,
    Sampling,
    as_text,
    digest,
    fingerprint,
    manifest_fingerprint,
    tensor_sums,
)
from relayrl.weightsync.manifest import WeightManifest, dtype_name

Method = Literal["fingerprint", "sha256"]
METHODS: tuple[str, ...] = ("fingerprint", "sha256")


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256(name \\0 dtype \\0 shape \\0 || raw bytes), as bytes."""
    digest = hashlib.sha256(f"{name}\0{dtype_name(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
    digest.update(memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.digest()


def checksum_method(checksum: str) -> Method:
    """The method that made ``checksum`` ("fp:..." -> fingerprint, hex -> sha256); fingerprint for ""."""
    return "sha256" if checksum and not checksum.startswith(PREFIX) else "fingerprint"


def weights_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, method: Method = "fingerprint", threads: int | None = None
) -> str:
    """The checksum of every (name, tensor) by ``method``; any dtype (bfloat16 included) is taken by its
    bytes, so equal checksums mean the same weights. Tensors stay where they are (fingerprint: summed on
    their device, 16 bytes each come back). ValueError on a repeated name or an unknown method.

    ``threads``: sha256 hashing threads (default min(8, CPU count)); the checksum does not depend on it.
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in by_name:
            raise ValueError(f"{name}: appears twice")
        by_name[name] = tensor
    if method == "fingerprint":
        return fingerprint(list(by_name.items()))
    names = sorted(by_name)
    with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(tensor_digest, names, [by_name[name] for name in names])
        return hashlib.sha256(b"".join(digests)).hexdigest()


def manifest_checksum(manifest: WeightManifest, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The checksum a receiver of ``manifest`` reports for the tensors it loaded: the sampled fingerprint at
    the manifest's places (``verify: sampled``), else ``weights_checksum`` by the method of its checksum."""
    if manifest.verify == "sampled":
        return manifest_fingerprint(manifest, list(named_tensors))
    return weights_checksum(named_tensors, method=checksum_method(manifest.checksum))


class ChecksumParts:
    """``weights_checksum`` by ``method``, taken one tensor at a time: for tensors that do not outlive their
    chunk (staging views). Each ``add`` keeps only the tensor's part (a sha256 digest, or its two sums).
    ``for_manifest``: ``manifest_checksum``'s rule."""

    def __init__(self, method: Method, sampling: Sampling = FULL, places: dict[str, int] | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"method: {method!r} is not one of {METHODS}")
        self.method, self.sampling, self.places = method, sampling, places or {}
        self._digests: dict[str, bytes] = {}
        self._records: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._sums: list[torch.Tensor] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.method == "sha256":
            self._digests[name] = tensor_digest(name, tensor)
        else:
            self._records.append((name, tensor.dtype, tuple(tensor.shape)))
            self._sums.append(tensor_sums(tensor, self.sampling, self.places.get(name, 0)).to("cpu"))

    @classmethod
    def for_manifest(cls, manifest: WeightManifest) -> ChecksumParts:
        sampling = Sampling.of(manifest)
        return cls(checksum_method(manifest.checksum), sampling, {t.name: t.offset // BLOCK for t in manifest.tensors})

    def checksum(self) -> str:
        if self.method == "sha256":
            return hashlib.sha256(b"".join(self._digests[name] for name in sorted(self._digests))).hexdigest()
        sums = torch.stack(self._sums) if self._sums else torch.zeros(0, 2, dtype=torch.int64)
        return as_text(digest(self._records, sums, self.sampling), self.sampling)
