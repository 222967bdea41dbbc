"""A content hash of named weights, for checking that trainer and workers hold the same bytes.

    tensor(t) = sha256(name \\0 dtype \\0 shape \\0 || bytes of t viewed as uint8)
    checksum  = sha256(tensor(t) for t in sorted name order), hex

Tensors are hashed on a thread pool (hashlib releases the GIL on large buffers; a tensor that is
not on the CPU is copied there by its own task, so at most ``threads`` such copies exist at once):
the hash of a model runs at up to ``threads`` x one core's sha256 speed (~1.8 GB/s per core with
SHA-NI), bounded below by its largest tensor.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from relayrl.weightsync.manifest import dtype_name


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256(name \\0 dtype \\0 shape \\0 || raw bytes), as bytes."""
    digest = hashlib.sha256(f"{name}\0{dtype_name(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
    digest.update(memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.digest()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]], *, threads: int | None = None) -> str:
    """The checksum above over every (name, tensor); any dtype (bfloat16 included) is hashed by its
    bytes, so equal digests mean bit-identical weights. ValueError on a repeated name.

    ``threads``: hashing threads (default min(8, CPU count)); the digest does not depend on it.
    """
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in by_name:
            raise ValueError(f"{name}: appears twice")
        by_name[name] = tensor
    names = sorted(by_name)
    with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(tensor_digest, names, [by_name[name] for name in names])
        return hashlib.sha256(b"".join(digests)).hexdigest()
