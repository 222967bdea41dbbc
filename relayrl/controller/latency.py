"""A fixed-bucket latency histogram (thread-safe, no dependencies), exported by the controller's /metrics.

Buckets grow by sqrt(2) from 0.25 ms to about 17 minutes, so a quantile interpolated inside its bucket
(Prometheus ``histogram_quantile``) is off by at most the bucket's width: 41 % of its lower bound.
"""

from __future__ import annotations

import bisect
import threading

BUCKETS: tuple[float, ...] = tuple(0.00025 * 2 ** (k / 2) for k in range(45))


class LatencyHistogram:
    """``observe(seconds)``; ``snapshot()`` -> (cumulative counts per bucket upper bound, +Inf count, sum)."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bucket
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[float, int]], int, float]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip(self.buckets, counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, running + counts[-1], total
