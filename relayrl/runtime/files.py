"""Files that survive a crash: written whole or not at all, and durable once the call returns."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory by name (a directory: the names in it, a rename's durability)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a temp file beside ``path``, fsync it, rename it over ``path``, fsync the directory: readers (and a
    restart after a crash or a lost host) see the old file or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def free_space_text(path: str | os.PathLike[str]) -> str:
    """ "N.N GiB free" (or MiB, KiB) on the filesystem holding ``path`` (its nearest existing parent), for an error
    that a full disk may explain; "" when that cannot be read."""
    existing = next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)
    try:
        free = shutil.disk_usage(existing).free if existing is not None else None
    except OSError:
        free = None
    if free is None:
        return ""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20)) if free >= s), ("KiB", 2**10))
    return f"{free / scale:.1f} {unit} free"
