"""Process-tree helpers (Linux /proc)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn


def announce(line: str) -> None:
    """``line`` and its newline on stdout in one write(2), which a pipe keeps whole (up to PIPE_BUF bytes) when
    processes share it (the servers of ``relayrl env serve --processes N``). ``print`` under PYTHONUNBUFFERED
    writes the text and the newline apart, so two processes' lines could interleave into one."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def command_line(pid: int | str) -> str:
    """``pid``'s command line, its arguments joined by spaces (/proc/<pid>/cmdline); OSError once it is gone or
    belongs to a user this process may not inspect."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before children."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in child_pids(p)]
        found += children
        frontier = children
    return found


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_tree(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal ``pid`` and everything below it (collected first, so reparenting cannot hide any)."""
    signal_pids([pid, *descendants(pid)], sig)


def exit_now(code: int) -> NoReturn:
    """Flush stdio and logging, then ``os._exit(code)``.

    For a process that has finished cleanly (servers stopped, files closed, process groups destroyed): the
    interpreter's own teardown has nothing left to do but a final garbage collection over every torch and
    transformers object, which would cost seconds of a core at every stop of every role."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


PARENT_ENV = "RELAYRL_PARENT_PID"  # set by ``relayrl up`` for its children; read once, never inherited further
PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 60.0  # twice the launcher's own per-role stop grace (relayrl/launcher.py)


def stop_with_parent(*, watchdog_s: float | None = ORPHAN_GRACE_S) -> None:
    """In a child of ``relayrl up``: receive SIGTERM when the launcher dies, however it dies (SIGKILL included).

    The launcher puts its pid in ``PARENT_ENV``; the child pops it (its own children must not act on it) and asks
    the kernel for PR_SET_PDEATHSIG (sent when the thread that forked us exits: the launcher forks from its main
    thread only). A launcher gone before the call is caught by comparing the parent pid. SIGTERM is each role's
    clean stop: the trainer finishes its step and checkpoints, workers drain.

    A launcher stopping a role SIGKILLs it after a grace; a dead launcher cannot, so ``watchdog_s`` (None: no
    watchdog, for a process that must stay single-threaded) does it: ``watchdog_s`` after the launcher is gone, a
    role still running writes every thread's stack to stderr (its log) and SIGKILLs itself and its children."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logging.getLogger(__name__).warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if watchdog_s is not None:
        watchdog = threading.Thread(target=_kill_when_orphaned, args=(int(parent), watchdog_s), daemon=True)
        watchdog.name = "orphan-watchdog"
        watchdog.start()
    if os.getppid() != int(parent):  # the launcher died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def log_native_crashes() -> None:
    """Every thread's Python stack to stderr (a role's log) when the process dies of a native crash: SIGSEGV, or
    SIGABRT from glibc's heap checks, which alone say one line (faulthandler). Not where stderr is no file (a
    caller that captures it in memory)."""
    with contextlib.suppress(AttributeError, ValueError):  # io.UnsupportedOperation is a ValueError
        faulthandler.enable(all_threads=True)


def _kill_when_orphaned(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(grace_s)
    logging.getLogger(__name__).error(
        "the launcher (pid %d) died %.0fs ago and this process has not stopped: killing it and its children; "
        "every thread's stack follows", parent, grace_s,
    )  # fmt: skip
    faulthandler.dump_traceback(all_threads=True)
    signal_pids(descendants(os.getpid()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> None:
    """Make this process a child subreaper (prctl(2)): orphans below it are reparented to it, not to init, so it
    can wait for them and read their exit status; ``on=False`` ends that (children it adopted stay its own).
    Raises OSError where the kernel refuses (or is not Linux)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        raise OSError("PR_SET_CHILD_SUBREAPER needs Linux")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def reap_orphans(keep: set[int]) -> list[int]:
    """Reap this process's exited children that are not in ``keep`` (orphans a subreaper inherited); their pids."""
    reaped = []
    for pid in child_pids(os.getpid()):
        if pid in keep:
            continue
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z" and os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped
