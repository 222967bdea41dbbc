"""Counts in messages: ``counted(1, "worker")`` is "1 worker", ``counted(3, "worker")`` "3 workers"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``plural``, else noun + "s") unless count is 1."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
