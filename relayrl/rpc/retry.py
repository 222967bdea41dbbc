"""The one retry policy of relayrl's gRPC calls: the SDK (relayrl/client) and the roles use it alike.

Which codes are tried again (``RETRYABLE``): UNAVAILABLE (the peer was not reached, is restarting, paused, or has no
worker yet) and DEADLINE_EXCEEDED of one try (the peer did not answer this time: hung, restarting, overloaded).
Every other code is the peer's answer and is raised at once. A call has one deadline that covers all its tries
(each try gets what is left of it, unless it keeps its own shorter timeout); between tries it waits ``backoff_s`` x
2^k, at most ``max_backoff_s``, with +-``jitter``; it gives up when the next wait would end past the deadline, after
``attempts`` tries (None: the deadline alone decides), or at once when this process is stopping (``STOPPING``). So
a DEADLINE_EXCEEDED that used the whole deadline is never retried; a try that timed out early is.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Set when this process was asked to stop (SIGTERM): a retry then gives up at once instead of waiting out a peer
# that is stopping too (every child of a killed `relayrl up` gets SIGTERM at the same moment).
STOPPING = threading.Event()


@dataclass(frozen=True)
class RetryPolicy:
    """The waits between tries and how many tries (the codes are RETRYABLE for every caller)."""

    backoff_s: float = 0.5
    max_backoff_s: float = 5.0
    attempts: int | None = None  # tries in all; None: until the deadline
    jitter: float = 0.0  # +- this share of each wait (the SDK's: many clients retrying at once spread out)

    def waits(self) -> Iterator[float]:
        """The waits between a call's tries: ``attempts - 1`` of them (endless when attempts is None)."""
        delay, tries = self.backoff_s, 1
        while self.attempts is None or tries < self.attempts:
            yield delay * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay, tries = min(delay * 2, self.max_backoff_s), tries + 1

    def next_wait(self, err: grpc.RpcError, waits: Iterator[float], deadline: float) -> float | None:
        """How long to wait before trying again after ``err`` (``waits``: the call's ``waits()``, ``deadline``: its
        time.monotonic() deadline), or None: give up and raise ``err``."""
        if err.code() not in RETRYABLE or STOPPING.is_set():
            return None
        wait = next(waits, None)
        return None if wait is None or time.monotonic() + wait > deadline else wait

    def call(self, attempt: Callable[[float], T], *, deadline_s: float, what: str = "") -> T:
        """``attempt(seconds left)`` until it returns or the policy gives up (its last error raised). ``what``: a
        name for the one WARNING logged at the first retry (none when empty)."""
        deadline, waits, warned = time.monotonic() + deadline_s, self.waits(), not what
        while True:
            try:
                return attempt(max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as err:
                wait = self.next_wait(err, waits, deadline)
                if wait is None:
                    raise
                if not warned:
                    log.warning(
                        "%s: %s (%s); retrying for up to %.0fs", what, err.code().name, err.details(), deadline_s
                    )
                    warned = True
                time.sleep(wait)

    async def call_async(self, attempt: Callable[[float], Awaitable[T]], *, deadline_s: float) -> T:
        """``call`` in asyncio: ``await attempt(seconds left)``, the same policy."""
        deadline, waits = time.monotonic() + deadline_s, self.waits()
        while True:
            try:
                return await attempt(max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as err:
                wait = self.next_wait(err, waits, deadline)
                if wait is None:
                    raise
                await asyncio.sleep(wait)


# the roles' calls to each other: 0.5 s doubling to 2 s, until the call's deadline; a peer that comes back (a
# restarted controller: seconds) is reached within 2 s of it, and a try every 2 s costs a down peer nothing
SERVICES = RetryPolicy(max_backoff_s=2.0)


def call_with_retry(call: Callable[[], T], *, what: str, deadline_s: float) -> T:
    """``call()`` (each try with its own timeout) under the SERVICES policy for up to ``deadline_s``."""
    return SERVICES.call(lambda _left: call(), deadline_s=deadline_s, what=what)
