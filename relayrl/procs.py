"""Process-tree helpers (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before children."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in child_pids(p)]
        found += children
        frontier = children
    return found


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_tree(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal ``pid`` and everything below it (collected first, so reparenting cannot hide any)."""
    signal_pids([pid, *descendants(pid)], sig)
