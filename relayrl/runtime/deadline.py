"""Calling a function in worker processes with a deadline per call: a call past it kills its worker.

The controller scores groups on its dispatch threads, where a signal-based timeout (``signal.alarm``, what
math-verify uses by default) cannot run, and a thread cannot be stopped; a process can. Workers are fresh
interpreters (``python -m relayrl.runtime.deadline FD module:function PID``: no fork of the controller's threads, and
no re-run of its ``__main__`` as multiprocessing's spawn does), started on first use, at most ``workers`` at once,
and reused; a worker killed at its deadline is replaced on the next call, and every worker is killed with the
pool's process (PR_SET_PDEATHSIG), in a call or not. Calls and answers are pickled over a
socket pair (``multiprocessing.connection.Connection``).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from relayrl.imports import import_attr
from relayrl.runtime.procs import PR_SET_PDEATHSIG

# How long a new worker has to start and answer its warm-up (sympy and math-verify's first parse: seconds)
STARTUP_S = 120.0


class DeadlineExceeded(TimeoutError):
    """A call ran past its deadline; its worker was killed."""


def _serve(conn: Connection, fn: Callable[..., Any]) -> None:
    """A worker's loop: each received argument tuple answered with (True, fn(*args)) or (False, "Type: message")."""
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        if args is None:  # the ping of a new worker: its imports are done
            conn.send((True, None))
            continue
        try:
            conn.send((True, fn(*args)))
        except Exception as err:  # the caller raises it: one call's failure, not the worker's
            conn.send((False, f"{type(err).__name__}: {err}"))


# Workers are started from this one thread, which lives as long as the process: a worker's PR_SET_PDEATHSIG fires
# when the thread that started it exits (a dispatch thread may end before the process does)
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deadline-spawner")


class _Worker:
    def __init__(self, fn: Callable[..., Any]) -> None:
        ours, theirs = socket.socketpair()
        spec = f"{fn.__module__}:{fn.__qualname__}"
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), spec, str(os.getpid())]
        self.process = _SPAWNER.submit(subprocess.Popen, argv, pass_fds=(theirs.fileno(),)).result()
        theirs.close()
        self.conn = Connection(ours.detach())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class DeadlinePool:
    """``pool(*args)`` is ``fn(*args)`` run in a worker process, or DeadlineExceeded after ``timeout_s`` seconds.

    ``fn`` must be importable by name (a module-level function). A new worker's start is not charged to a call's
    deadline: it first answers ``fn(*warmup)`` (its lazy imports done; None: a ping alone), within STARTUP_S.
    """

    def __init__(
        self, fn: Callable[..., Any], *, workers: int, timeout_s: float, warmup: tuple[Any, ...] | None = None
    ) -> None:
        self.fn = fn
        self.warmup = warmup
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()

    def __call__(self, *args: Any) -> Any:
        with self._slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = self._started()
            try:
                worker.conn.send(args)
                answered = worker.conn.poll(self.timeout_s)
                ok, value = worker.conn.recv() if answered else (False, None)
            except (EOFError, OSError) as err:
                worker.kill()
                raise RuntimeError(f"{self.fn.__name__}'s worker process died ({type(err).__name__})") from None
            if not answered:
                worker.kill()
                raise DeadlineExceeded(f"{self.fn.__name__} ran past its {self.timeout_s:g} s deadline")
            self._idle.put(worker)
        if not ok:
            raise RuntimeError(value)
        return value

    def _started(self) -> _Worker:
        """A new worker that has answered its warm-up (or a ping), so a call's deadline counts ``fn`` alone;
        RuntimeError when it dies or is not ready within STARTUP_S."""
        worker = _Worker(self.fn)
        try:
            worker.conn.send(self.warmup)
            if worker.conn.poll(STARTUP_S):
                worker.conn.recv()
                return worker
        except (EOFError, OSError):
            pass
        worker.kill()
        raise RuntimeError(f"{self.fn.__name__}'s worker process did not start within {STARTUP_S:g} s")


def _die_with(parent: int) -> None:
    """SIGKILL this worker when ``parent`` (the pool's process) exits, however it exits: mid-call, a worker may be
    stuck in C (a big-integer power holds the GIL) and would never read the closed socket."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # gone before the call
        os._exit(0)


if __name__ == "__main__":  # a worker: python -m relayrl.runtime.deadline FD module:function PARENT_PID
    _die_with(int(sys.argv[3]))
    _serve(Connection(int(sys.argv[1])), import_attr(sys.argv[2], "deadline worker function"))
