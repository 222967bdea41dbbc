"""The reference policy's log-probs of a data set, computed once and kept in the run directory.

The key is a SHA-256 over the model directory's files (their names and bytes: config, weights, tokenizer) and the
rendered sequences (token ids and completion masks), so a cache is read back only for the same model and the same
tokens; anything else computes anew. A file is ``<run dir>/reference_logps/<key>.pt``: a float32 tensor [N, K]
(K log-probs per example), written atomically by rank 0.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from relayrl.runtime.files import atomic_write


def model_digest(path: str | Path) -> str:
    """SHA-256 of every file under the model directory ``path``, names and bytes, in sorted order."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode())
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def cache_key(model_hash: str, sequences: Sequence[Sequence[tuple[list[int], list[int]]]]) -> str:
    """The key of a data set whose example i forwards the sequences ``sequences[i]`` under the model ``model_hash``."""
    digest = hashlib.sha256(model_hash.encode())
    for example in sequences:
        digest.update(json.dumps(example, separators=(",", ":")).encode())
    return digest.hexdigest()[:32]


def cache_path(run_dir: Path, key: str) -> Path:
    return run_dir / "reference_logps" / f"{key}.pt"


def load_cached(run_dir: Path, key: str, count: int) -> torch.Tensor | None:
    """The cached tensor of ``key`` when there is one of ``count`` rows, else None."""
    path = cache_path(run_dir, key)
    if not path.exists():
        return None
    logps = torch.load(path, weights_only=True)
    return logps if logps.shape[0] == count else None


def save_cached(run_dir: Path, key: str, logps: torch.Tensor) -> None:
    """Write ``logps`` under ``key`` (rank 0's call)."""
    path = cache_path(run_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(logps.cpu(), buffer)
    atomic_write(path, buffer.getvalue())
