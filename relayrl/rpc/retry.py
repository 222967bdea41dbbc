"""Retrying gRPC calls that fail with a retryable status (the peer restarting, paused or busy)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Set when this process was asked to stop (SIGTERM): a retry then gives up at once instead of waiting out a peer
# that is stopping too (every child of a killed `relayrl up` gets SIGTERM at the same moment).
STOPPING = threading.Event()


def call_with_retry(
    call: Callable[[], T], *, what: str, deadline_s: float, backoff_s: float = 0.5, max_backoff_s: float = 5.0
) -> T:
    """``call()`` until it succeeds or fails with a non-retryable status; retryable failures back off
    exponentially until ``deadline_s`` has passed, then the last error is raised."""
    deadline = time.monotonic() + deadline_s
    delay = backoff_s
    warned = False
    while True:
        try:
            return call()
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE or time.monotonic() + delay > deadline or STOPPING.is_set():
                raise
            if not warned:
                log.warning("%s: %s (%s); retrying for up to %.0fs", what, err.code().name, err.details(), deadline_s)
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, max_backoff_s)
