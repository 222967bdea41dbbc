"""Where environment methods run: ``async def`` ones on one event-loop thread, plain ones on a thread pool.

Every call gets a deadline; a call past it answers DEADLINE_EXCEEDED at once (an async call is also cancelled;
a sync one cannot be interrupted and finishes on its pool thread). An exception the method raises comes back
as a ``RelayError``: a ``RelayError`` the environment raised keeps its status, anything else is INTERNAL with
the exception's type and message (its traceback logged here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable

import grpc

from relayrl.errors import RelayError

log = logging.getLogger(__name__)


class DeadlineExceeded(RelayError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class EnvironmentFailed(RelayError):
    """The environment's own code raised, or returned something that is not a valid answer."""

    code = grpc.StatusCode.INTERNAL


class Runner:
    """Runs environment methods off the caller's thread. ``workers``: pool threads for sync methods."""

    def __init__(self, workers: int = 32) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True).start()
            return self._loop

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Start ``fn(*args)``: on the event loop when ``fn`` is a coroutine function, else on the pool."""
        if inspect.iscoroutinefunction(fn):
            return asyncio.run_coroutine_threadsafe(fn(*args), self._event_loop())
        return self._pool.submit(fn, *args)

    @staticmethod
    def result(future: concurrent.futures.Future, timeout_s: float | None, what: str):
        """The value of ``future`` within ``timeout_s`` (None: no deadline); errors as described above."""
        done, _ = concurrent.futures.wait([future], timeout=timeout_s)
        if not done:
            future.cancel()  # cancels a coroutine; a running pool thread finishes on its own
            raise DeadlineExceeded(f"{what}: no answer within the call's deadline ({timeout_s:.3g} s)")
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise EnvironmentFailed(f"{what}: cancelled") from None
        except RelayError:
            raise
        except Exception as err:
            log.warning("%s raised", what, exc_info=err)
            raise EnvironmentFailed(f"{what} raised {type(err).__name__}: {err}") from None

    def call(self, fn: Callable, *args, timeout_s: float | None, what: str):
        return self.result(self.submit(fn, *args), timeout_s, what)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None
