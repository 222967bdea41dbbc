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
whose processes are still stopping from a live one; that refusal also names the processes that still have the lock
file open (``holders``: the descriptor the launcher handed down), so a run that will not stop says which one.

Where ``flock`` does not hold as it does on a local disk, the filesystem (``/proc/self/mountinfo``) is named in one
line: on NFS the kernel emulates it with a POSIX lock, which belongs to the launcher alone (its processes do not
inherit it), so the lock still excludes other hosts' launchers but is gone once the launcher dies (``caveat``); on
Lustre mounted ``localflock`` it excludes this node's launchers only (``caveat``); a filesystem that refuses
``flock`` (Lustre without ``-o flock``: ENOSYS) is a ``RunLockUnsupported`` naming it, not a traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from relayrl.runtime.procs import command_line

POLL_S = 0.5


class RunHeld(RuntimeError):
    """The run directory belongs to another live run; the message is one line naming its owner."""


class RunLockUnsupported(RuntimeError):
    """The runs directory's filesystem refuses ``flock``; the message is one line naming it and what to do."""


def filesystem_of(path: Path) -> tuple[str, frozenset[str]]:
    """The type and the superblock options of the filesystem holding ``path`` (the longest mount point of
    ``/proc/self/mountinfo`` above it); ("", {}) where there is no mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "", frozenset()
    target, best = str(Path(path).resolve()), ("", "", frozenset())
    for line in lines:
        mount_fields, _, fs_fields = line.partition(" - ")
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), mount_fields.split()[4])  # \040: a space
        fstype, _, options = [*fs_fields.split(), "", ""][:3]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype, frozenset(options.split(",")))
    return best[1], best[2]


def lock_caveat(path: Path) -> str | None:
    """One line on how the lock at ``path`` holds less than on a local disk (module docstring), or None."""
    fstype, options = filesystem_of(path.parent)
    if fstype.startswith("nfs"):
        return (
            f"run lock {path} is on {fstype}: NFS emulates flock with a POSIX lock that the run's processes do not "
            "inherit, so it guards the run while this launcher lives (other hosts' launchers are refused), not "
            "after; a local run.dir holds it until the run's last process exits"
        )
    if fstype == "lustre" and "localflock" in options:
        return f"run lock {path} is on lustre mounted localflock: it refuses a second run on this node only"
    return None


def _flock(fd: int, path: Path, operation: int) -> None:
    """``fcntl.flock``; a filesystem that refuses it (not a held lock: BlockingIOError passes) is
    ``RunLockUnsupported`` naming it."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        raise
    except OSError as err:
        os.close(fd)
        fstype = filesystem_of(path.parent)[0] or "its filesystem"
        hint = "mount it with -o flock" if fstype == "lustre" else "use a filesystem with flock"
        raise RunLockUnsupported(
            f"run lock {path}: {fstype} refuses flock ({err.strerror or err}); {hint}, or set run.dir on a local disk"
        ) from None


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
        self.caveat = lock_caveat(path)  # one line where the filesystem's flock holds less (module docstring)

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
        dead_owner = DeadOwnerWait(run_dir, wait_dead_s, on_wait)
        while True:
            created = not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                _flock(fd, path, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except RunLockUnsupported:  # refused before anything: leave nothing behind
                if created:
                    _remove(path, made_parent)
                raise
            except BlockingIOError:
                os.close(fd)
                dead_owner.held()
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
        """Give up a start refused before anything of the run was written: the lock file goes, and the runs
        directory when ``take`` made it and it is empty again (``_remove``); then the lock with the descriptor."""
        _remove(self.path, self.made_parent)
        os.close(self.fd)


def _remove(path: Path, made_parent: bool) -> None:
    """The lock file goes, and its directory when ``take`` made it and it is empty again."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    if made_parent:
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def same_file(fd: int, path: Path) -> bool:
    """``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


class DeadOwnerWait:
    """A claimant's wait, up to ``wait_dead_s``, for the processes of a launcher that died to let go of
    ``run_dir``'s lock (they stop within a grace once their launcher dies); said once to ``on_wait``."""

    def __init__(self, run_dir: Path, wait_dead_s: float, on_wait: Callable[[str], None]) -> None:
        self.run_dir, self.on_wait = run_dir, on_wait
        self.deadline = time.monotonic() + wait_dead_s
        self.waited = False

    def held(self) -> None:
        """The lock was found held: ``RunHeld`` naming the owner unless it is a dead launcher and the wait has time
        left, else one poll period's sleep before the caller tries again."""
        owner = read_owner(RunLock.path_for(self.run_dir))
        if owner is None or not owner.gone() or time.monotonic() >= self.deadline:
            raise RunHeld(refusal(self.run_dir, owner))
        if not self.waited:
            self.on_wait(f"run {self.run_dir.name}: its launcher ({owner.describe()}) died; waiting for its processes")
            self.waited = True
        time.sleep(POLL_S)


def refuse_if_held(run_dir: Path, *, wait_dead_s: float = 0.0, on_wait: Callable[[str], None] = print) -> bool:
    """``RunHeld`` naming the owner when a live run holds ``run_dir``; creates nothing (no lock file: no live run).
    A dead launcher's processes still holding it are waited for as ``RunLock.take`` does; returns whether they were
    (so what they held, a port, may be free now)."""
    path = RunLock.path_for(run_dir)
    dead_owner = DeadOwnerWait(run_dir, wait_dead_s, on_wait)
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return dead_owner.waited
        try:
            _flock(fd, path, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe: dropped with the descriptor below
        except BlockingIOError:
            os.close(fd)
            dead_owner.held()
            continue
        os.close(fd)
        return dead_owner.waited


def read_owner(path: Path) -> Owner | None:
    """The record in a lock file, None when there is none or it is being written."""
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def holders(path: Path) -> list[str]:
    """The processes of this host that have ``path`` open and that this user may inspect, each as
    "pid PID (COMMAND LINE)" (``/proc/PID/fd``; the lock belongs to every descriptor of its open file)."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.path.samestat(os.stat(fd), target) for fd in (entry / "fd").iterdir()):
                found.append(f"pid {entry.name} ({command_line(entry.name)[:120]})")
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def refusal(run_dir: Path, owner: Owner | None) -> str:
    """The one line a second claimant is refused with; for a dead launcher, with the processes still holding it."""
    path = RunLock.path_for(run_dir)
    who = owner.describe() if owner is not None else "a process that has not written its record yet"
    state = ""
    if owner is not None and owner.gone():
        state = f" (its launcher died; its processes are still stopping: {'; '.join(holders(path)) or 'none seen'})"
    return f"run {run_dir} is held by {who}{state}: one live run per run directory (lock {path})"
