"""One live run per run directory: an exclusive ``flock`` on a lock file beside it, owned by the run's processes.

Every claimant opens the lock file (``<runs>/.<name>.lock``) and ``flock(LOCK_EX | LOCK_NB)`` both checks and
takes it in one step. The file is never renamed; it is removed only by its holder, once the run's processes have
stopped (``release``) or when it gives up a start that found no run directory (``abandon``), so no lock file is
left behind by a run that ended, and a claimant that locked checks that the name still leads to its inode (else
it locked a removed file, and tries again). The kernel drops the lock when the last
descriptor of its open file closes: a dead run cannot keep it, however it died, and taking over from a dead owner
is the same atomic call. The launcher hands the descriptor to the processes it starts (``fd``), so the lock is
held until the last of them has exited, not only the launcher.

The holder writes its record (pid, host, the process's start time in clock ticks since boot from
``/proc/PID/stat``, and the wall time it took the lock) into the file: a refusal names the owner, and a claimant
on the owner's host tells a dead launcher (no process with that pid and start time: a reused pid has another)
whose processes are still stopping from a live one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

POLL_S = 0.5


class RunHeld(RuntimeError):
    """The run directory belongs to another live run; the message is one line naming its owner."""


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (the start time in clock ticks since boot), None when no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3


@dataclass(frozen=True)
class Owner:
    """Who holds a run's lock: the launcher's ``pid`` on ``host``, started at ``start_ticks``, holding it since
    ``since`` (epoch seconds)."""

    pid: int
    host: str
    start_ticks: int | None
    since: float

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), process_start_ticks(os.getpid()), time.time())

    def gone(self) -> bool:
        """The launcher is known dead: on this host, no process has its pid and start time."""
        return self.host == socket.gethostname() and process_start_ticks(self.pid) != self.start_ticks

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on {self.host} since {since}"


class RunLock:
    """The held lock of one run directory; ``fd`` is the descriptor to pass to the run's processes."""

    def __init__(self, path: Path, fd: int, *, made_parent: bool = False) -> None:
        self.path = path
        self.fd = fd
        self.made_parent = made_parent  # ``take`` made the runs directory

    @staticmethod
    def path_for(run_dir: Path) -> Path:
        return run_dir.with_name(f".{run_dir.name}.lock")

    @classmethod
    def take(cls, run_dir: Path, *, wait_dead_s: float = 0.0, on_wait: Callable[[str], None] = print) -> RunLock:
        """Lock ``run_dir`` for this process (its parent directory made if missing), or raise ``RunHeld`` naming
        the owner. An owner whose launcher is gone (``Owner.gone``) but whose processes still hold the lock (they
        stop within a grace once their launcher dies) is waited for up to ``wait_dead_s``, said once to
        ``on_wait``."""
        path = cls.path_for(run_dir)
        made_parent = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_dead_s
        waited = False
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                owner = read_owner(path)
                if owner is None or not owner.gone() or time.monotonic() >= deadline:
                    raise RunHeld(refusal(run_dir, owner)) from None
                if not waited:
                    on_wait(f"run {run_dir.name}: its launcher ({owner.describe()}) died; waiting for its processes")
                    waited = True
                time.sleep(POLL_S)
                continue
            if same_file(fd, path):
                break
            os.close(fd)  # its holder removed it between our open and our lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(Owner.me())).encode(), 0)
        return cls(path, fd, made_parent=made_parent)

    def release(self) -> None:
        """The run is over and every process it started has stopped: the lock file goes, then the lock with the
        descriptor (a claimant that opened the file meanwhile finds, once it locks, that its name is gone)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)

    def abandon(self) -> None:
        """Give up a start refused before anything of the run was written: ``release``, then the runs directory
        goes too when ``take`` made it and it is empty again."""
        self.release()
        if self.made_parent:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def same_file(fd: int, path: Path) -> bool:
    """``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def refuse_if_held(run_dir: Path) -> None:
    """``RunHeld`` naming the owner when a live run holds ``run_dir``; creates nothing (no lock file: no live run)."""
    path = RunLock.path_for(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe: dropped with the descriptor below
    except BlockingIOError:
        raise RunHeld(refusal(run_dir, read_owner(path))) from None
    finally:
        os.close(fd)


def read_owner(path: Path) -> Owner | None:
    """The record in a lock file, None when there is none or it is being written."""
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def refusal(run_dir: Path, owner: Owner | None) -> str:
    """The one line a second claimant is refused with."""
    who = owner.describe() if owner is not None else "a process that has not written its record yet"
    state = " (its launcher died; its processes are still stopping)" if owner is not None and owner.gone() else ""
    return f"run {run_dir} is held by {who}{state}: one live run per run directory (lock {RunLock.path_for(run_dir)})"
