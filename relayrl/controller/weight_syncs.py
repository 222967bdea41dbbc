"""Operator weight-sync requests and the history of weight updates, as the controller knows them.

An operator's SyncWeights gets an increasing request id; the trainer sees the newest pending id in
its WeightSyncPlan, pushes the weights and answers with ReportWeightSync(sync_request_id), which
marks every request up to that id handled. Every update (per step or on demand) is recorded.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from relayrl.v1 import controller_pb2

HISTORY = 32


class WeightSyncLog:
    """Thread-safe: pending requests, the last ``HISTORY`` updates, and per-reason totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 1
        self._handled = 0
        self._pending_force = False
        self._history: deque[controller_pb2.WeightSyncRecord] = deque(maxlen=HISTORY)
        self.count: Counter[str] = Counter()  # reason -> updates
        self.seconds: Counter[str] = Counter()  # reason -> summed wall time

    def request(self, force: bool) -> int:
        """A new operator request; returns its id."""
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            self._pending_force = self._pending_force or force
            return request_id

    def pending(self) -> tuple[int, bool]:
        """(newest unhandled request id or 0, whether any pending request asked for force)."""
        with self._lock:
            newest = self._next_id - 1
            return (newest, self._pending_force) if newest > self._handled else (0, False)

    @property
    def handled(self) -> int:
        with self._lock:
            return self._handled

    def record(self, record: controller_pb2.WeightSyncRecord) -> None:
        """Add an update; one that answers request ``r`` marks every request <= r handled."""
        record.unix_time = record.unix_time or time.time()
        with self._lock:
            self._history.append(record)
            self.count[record.reason] += 1
            self.seconds[record.reason] += record.seconds
            if record.sync_request_id > self._handled:
                self._handled = record.sync_request_id
                if self._handled >= self._next_id - 1:
                    self._pending_force = False

    def history(self) -> list[controller_pb2.WeightSyncRecord]:
        with self._lock:
            return list(self._history)
