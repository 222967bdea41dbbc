"""A per-machine cache of built assets: a built asset is a pure function of its settings, so it is built once.

An asset's directory is ``<cache>/<name>-<key>``, where ``key`` hashes its settings, relayrl's version, the
source of the modules that build it, and the torch and transformers versions (an edit to a builder or an upgrade
builds anew; nothing else does). ``<cache>`` is ``$RELAYRL_CACHE``, else ``$XDG_CACHE_HOME/relayrl``, else
``~/.cache/relayrl``. A build holds an exclusive lock on ``<cache>/.<name>-<key>.lock`` (a second run that wants
the same asset waits for it, then uses it) and is published by renaming a temp directory into place, so a
directory that exists is complete, even after a crash or on a filesystem whose locks do not hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MARKER = "relayrl-asset.json"  # written last into a build: its inputs, for whoever reads the cache


def cache_root() -> Path:
    """``$RELAYRL_CACHE``, else ``$XDG_CACHE_HOME/relayrl``, else ``~/.cache/relayrl``."""
    if os.environ.get("RELAYRL_CACHE"):
        return Path(os.environ["RELAYRL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "relayrl"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _source(module: str) -> bytes:
    """The source file of ``module``, found without importing it (a builder imports torch and transformers)."""
    return Path(importlib.util.find_spec(module).origin).read_bytes()


def asset_inputs(name: str, settings: dict, builders: tuple[str, ...]) -> dict:
    """Everything a build of ``name`` depends on: ``settings``, the builder modules' source, the versions."""
    sources = hashlib.sha256(b"".join(_source(m) for m in builders)).hexdigest()
    versions = {dist: _version(dist) for dist in ("relayrl", "torch", "transformers")}
    return {"name": name, "settings": settings, "builder_sources": sources, "versions": versions}


def asset_path(name: str, settings: dict, builders: tuple[str, ...]) -> Path:
    """``<cache>/<name>-<key>``: the key is the first 16 hex digits of the inputs' sha256."""
    inputs = json.dumps(asset_inputs(name, settings, builders), sort_keys=True)
    return cache_root() / f"{name}-{hashlib.sha256(inputs.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No tqdm bars from transformers or the hub while building ("Writing model shards"): one line says it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _readable(directory: Path) -> None:
    """Give the build the modes a plain copy would have (mkdtemp and safetensors make theirs owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cached_asset(
    name: str, settings: dict, builders: tuple[str, ...], build: Callable[[Path], object], *, what: str
) -> Path:
    """The cached directory of asset ``name`` built with ``settings`` by ``build(directory)`` (``builders``: the
    names of the modules whose source decides its bytes); builds it first when no run on this machine has, saying so
    in two lines (``what`` names it): the build and where it goes, then how long it took."""
    final = asset_path(name, settings, builders)
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process building {what} into {final}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / MARKER).is_file():
            return final
        _say(f"building {what} into {final} (once on this machine; later runs reuse it)")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            with _quiet_progress_bars():
                build(tmp)
            inputs = asset_inputs(name, settings, builders)
            (tmp / MARKER).write_text(json.dumps(inputs, indent=2, sort_keys=True) + "\n")
            _readable(tmp)
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():  # not "another builder got there first" (a lock that did not hold)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"built {what} in {time.monotonic() - started:.1f} s")
    return final
