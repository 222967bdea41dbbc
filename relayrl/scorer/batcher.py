"""Dynamic batching across requests: items from concurrent callers share one model call.

One thread owns the model. ``submit(items)`` queues a request's items and blocks until each has its result. The
loop takes the oldest waiting item, then waits up to ``max_wait_s`` from that item's arrival for more, until
``max_batch_size`` items are gathered (a request larger than that spreads over several calls), runs the model once
on them and hands every item its result. A model call that raises fails every request with an item in it (with
that error); ``run`` may instead return an Exception for one item, which fails that item's request alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class BatcherStopped(RuntimeError):
    """The batcher was stopped before this request was answered."""


@dataclass
class _Request(Generic[Item]):
    items: Sequence[Item]
    arrived: float
    results: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    left: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)
        self.left = len(self.items)


@dataclass
class BatchStats:
    """What the batcher has done since it started (``relayrl status``, /metrics, Describe)."""

    items: int = 0
    batches: int = 0
    latency_s_total: float = 0.0
    requests: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.batches if self.batches else 0.0

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s_total / self.requests if self.requests else 0.0


class DynamicBatcher(Generic[Item, Result]):
    """``run(items) -> results`` (one per item, in order) called on batches of up to ``max_batch_size`` items
    gathered from every caller of ``submit`` within ``max_wait_s`` of the oldest one's arrival."""

    def __init__(
        self, run: Callable[[list[Item]], list[Result | Exception]], *, max_batch_size: int, max_wait_s: float
    ) -> None:
        self.run, self.max_batch_size, self.max_wait_s = run, max_batch_size, max_wait_s
        self.stats = BatchStats()
        self._waiting: deque[tuple[_Request, int]] = deque()  # (request, index of the item)
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="scorer-batcher", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._waiting)

    def submit(self, items: Sequence[Item]) -> list[Result]:
        """Each item's result, once all are done; the error of the request's first failed item (or model call)."""
        request = _Request(items, time.monotonic())
        with self._cond:
            if self._stopped:
                raise BatcherStopped("the scorer is stopping")
            self._waiting.extend((request, i) for i in range(len(items)))
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        with self._cond:
            self.stats.requests += 1
            self.stats.latency_s_total += time.monotonic() - request.arrived
        return request.results

    def stop(self) -> None:
        """Answer every waiting request with BatcherStopped and end the loop (a model call running finishes)."""
        with self._cond:
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for request, _ in waiting:
            self._fail(request, BatcherStopped("the scorer is stopping"))
        self._thread.join(timeout=30)

    def _take(self) -> list[tuple[_Request, int]] | None:
        with self._cond:
            while not self._waiting and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            until = self._waiting[0][0].arrived + self.max_wait_s
            while len(self._waiting) < self.max_batch_size and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
                if self._stopped:
                    return None
            return [self._waiting.popleft() for _ in range(min(self.max_batch_size, len(self._waiting)))]

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                results = self.run([request.items[i] for request, i in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"the model returned {len(results)} results for {len(batch)} items")
            except Exception as err:  # the model failed this call: its requests fail, the loop goes on
                results = [err] * len(batch)
            with self._cond:
                self.stats.items += len(batch)
                self.stats.batches += 1
            for (request, i), result in zip(batch, results):
                if isinstance(result, Exception):
                    self._fail(request, result)
                    continue
                request.results[i] = result
                request.left -= 1
                if request.left == 0 and request.error is None:
                    request.done.set()

    @staticmethod
    def _fail(request: _Request, error: BaseException) -> None:
        if request.error is None:
            request.error = error
        request.done.set()
