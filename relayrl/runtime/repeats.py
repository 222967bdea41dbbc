"""Warnings that recur every step, logged once per ``every`` occurrences with their count."""

from __future__ import annotations

import logging
import threading
from collections import Counter


class RepeatedWarning:
    """``warn(key, msg, *args)`` logs occurrence 1, every+1, 2*every+1, ... of ``key`` (the first at once, then one
    line per ``every``), each with how many times it happened so far; the others are counted, not logged."""

    def __init__(self, log: logging.Logger, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"every: must be >= 1, got {every}")
        self.log, self.every = log, every
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args: object) -> bool:
        """Count ``key``; True when this occurrence was logged."""
        with self._lock:
            self.counts[key] += 1
            count = self.counts[key]
        if (count - 1) % self.every:
            return False
        suffix = f" [{count} times so far; logged once every {self.every}]" if count > 1 else ""
        self.log.warning(msg + suffix, *args)
        return True
