"""Filesystem fallback, driven by the same manifest as the broadcast path.

Layout of ``root``::

    v0000000042/bucket-00000.safetensors ...   one shard per bucket
    v0000000042/manifest.json                  the manifest (proto JSON, transport="filesystem")
    LATEST                                     {"version": 42}: written last, atomically

A reader trusts a version only once ``LATEST`` names it, so it never sees a half-written update.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from relayrl.errors import FailedPrecondition
from relayrl.runtime.files import atomic_write, fsync_path
from relayrl.weightsync.manifest import WeightManifest, dtype_name
from relayrl.weightsync.receiver import LoadFn
from relayrl.weightsync.stats import ReceiveStats, SendStats

MARKER = "LATEST"
log = logging.getLogger(__name__)


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    return Path(root) / f"v{version:010d}"


def shard_path(root: str | os.PathLike[str], version: int, bucket: int) -> Path:
    return version_dir(root, version) / f"bucket-{bucket:05d}.safetensors"


def _shard_tensors(manifest: WeightManifest, index: int, tensors: Mapping[str, torch.Tensor]) -> dict:
    """CPU, contiguous tensors of one bucket; tensors sharing storage (tied weights) are copied,
    since safetensors refuses shared storage."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for spec in manifest.bucket_tensors(index):
        t = tensors[spec.name].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[spec.name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def write_weights(
    root: str | os.PathLike[str], manifest: WeightManifest, tensors: Mapping[str, torch.Tensor], *, keep: int = 2
) -> SendStats:
    """Write one shard per bucket + manifest.json, fsync them, then flip ``LATEST`` to the version.

    After the flip, other versions are deleted but for the ``keep - 1`` newest (the one just
    published is always kept, even when it is not the highest number: a trainer resumed from an
    older checkpoint).
    """
    manifest.validate_against([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
    start = time.perf_counter()
    vdir = version_dir(root, manifest.version)
    vdir.mkdir(parents=True, exist_ok=True)
    for bucket in manifest.buckets:
        path = shard_path(root, manifest.version, bucket.index)
        save_file(_shard_tensors(manifest, bucket.index, tensors), str(path))
        fsync_path(path)
    stored = replace(manifest, transport="filesystem", path=str(Path(root).resolve()))
    atomic_write(vdir / "manifest.json", stored.to_json())
    fsync_path(vdir)
    atomic_write(Path(root) / MARKER, json.dumps({"version": manifest.version}))
    _prune(Path(root), vdir, keep)
    return SendStats(time.perf_counter() - start, manifest.total_bytes, len(manifest.buckets), 0)


def _prune(root: Path, current: Path, keep: int) -> None:
    """Delete the versions beyond ``keep``; one that cannot be deleted is logged at WARNING (its full copy of the
    model stays on disk, and the next publish tries again), never raised: the new version is published."""
    others = sorted(p for p in root.glob("v" + "[0-9]" * 10) if p.is_dir() and p != current)
    for old in others[: max(0, len(others) - (keep - 1))]:
        remove_tree(old, "an old weights version")


def remove_tree(path: str | os.PathLike[str], what: str) -> bool:
    """``rmtree`` that tells: False, with a WARNING naming ``what``, ``path`` and the error, when it fails (a
    directory already gone is removed)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return True
    except OSError as err:
        log.warning("cannot delete %s %s (it stays on disk): %s", what, path, err)
        return False
    return True


def latest_version(root: str | os.PathLike[str]) -> int | None:
    """The version ``LATEST`` names, or None when nothing was published yet."""
    try:
        return int(json.loads((Path(root) / MARKER).read_text(encoding="utf-8"))["version"])
    except FileNotFoundError:
        return None


def read_weights(root: str | os.PathLike[str], manifest: WeightManifest, load_fn: LoadFn) -> ReceiveStats:
    """Load ``manifest``'s version shard by shard, calling ``load_fn`` once per bucket.

    FailedPrecondition if ``LATEST`` does not name this version or the stored layout differs;
    ValueError naming the tensor if a shard does not match the manifest.
    """
    start = time.perf_counter()
    published = latest_version(root)
    if published != manifest.version:
        raise FailedPrecondition(f"version: {root} publishes {published}, the manifest brings {manifest.version}")
    stored = WeightManifest.from_json((version_dir(root, manifest.version) / "manifest.json").read_text("utf-8"))
    if stored.tensors != manifest.tensors or stored.buckets != manifest.buckets:
        raise FailedPrecondition(f"version: the layout stored for version {manifest.version} differs")
    peak = 0
    for bucket in manifest.buckets:
        shard = load_file(str(shard_path(root, manifest.version, bucket.index)))
        peak = max(peak, sum(t.numel() * t.element_size() for t in shard.values()))
        load_fn(_check_shard(shard, manifest, bucket.index))
        del shard
    return ReceiveStats(time.perf_counter() - start, manifest.total_bytes, len(manifest.buckets), peak)


def _check_shard(
    shard: dict[str, torch.Tensor], manifest: WeightManifest, index: int
) -> list[tuple[str, torch.Tensor]]:
    """The shard's tensors in manifest order; ValueError naming the first that is missing or differs."""
    out = []
    for spec in manifest.bucket_tensors(index):
        t = shard.get(spec.name)
        if t is None or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            got = "missing" if t is None else f"{dtype_name(t.dtype)} {list(t.shape)}"
            raise ValueError(f"{spec.name}: {got} in shard {index}, the manifest says {list(spec.shape)}")
        out.append((spec.name, t))
    return out
