"""Common beginnings of token sequences: how many leading items sequences share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix_length(ids: Sequence[Any], other: Sequence[Any]) -> int:
    """How many leading items ``ids`` and ``other`` share (TRL's ``common_prefix_length``)."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def shared_beginning(sequences: Sequence[Sequence[Any]]) -> int:
    """How many leading items every one of ``sequences`` shares: as many as the lexicographically first and last do,
    since every sequence between them begins with those too."""
    return common_prefix_length(min(sequences), max(sequences))
