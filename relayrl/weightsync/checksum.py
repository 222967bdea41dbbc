"""A content hash of named weights, for checking that trainer and workers hold the same bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from relayrl.weightsync.manifest import dtype_name


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over, for each tensor in sorted name order: name, dtype, shape, raw bytes (hex digest).

    Any dtype (bfloat16 included) is hashed by its bytes (viewed as uint8), so equal digests mean
    bit-identical weights. ValueError on a repeated name.
    """
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in by_name:
            raise ValueError(f"{name}: appears twice")
        by_name[name] = tensor
    digest = hashlib.sha256()
    for name in sorted(by_name):
        t = by_name[name].detach()
        header = f"{name}\0{dtype_name(t.dtype)}\0{list(t.shape)}\0"
        digest.update(header.encode())
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(memoryview(raw.numpy()))
    return digest.hexdigest()
