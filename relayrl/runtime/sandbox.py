"""Run untrusted Python code in a separate process under resource limits (the ``run_python`` tool of environments,
the ``code_tests`` reward).

What is enforced, and where:
- CPU time: ``RLIMIT_CPU`` (soft ``cpu_s``: SIGXCPU ends the process; hard ``cpu_s + 1``: SIGKILL), per process.
- Memory: ``RLIMIT_AS`` (``memory_mb`` of address space): an allocation past it fails (Python: MemoryError).
- Output: stdout and stderr go to files capped by ``RLIMIT_FSIZE`` (``max_output_bytes``: SIGXFSZ past it); the
  caller reads back at most ``output_chars`` of each.
- Wall time: the caller kills the process group (the code and anything it started) after ``wall_s``.
- Processes: at most ``max_processes`` tasks (processes and threads) at once. Where the caller may create a pids
  cgroup (root with a writable pids controller) each run gets its own (``pids.max``): the child joins it before
  anything else, a fork past the cap fails (EAGAIN), and after the run every process left in it is killed, even
  one that left the process group; ``Execution.forks_refused`` counts the refused forks. Else ``RLIMIT_NPROC``
  (it binds a non-root user only: the kernel exempts root); as root without a cgroup neither binds, so the audit
  hook also refuses ``ctypes`` (its way past the hook). ``Execution.process_cap`` says which.
- No network, two layers. (1) Namespaces: the child unshares a new user + network namespace (unshare(2), via
  ``os.unshare`` where Python has it (3.12+), else libc through ctypes), else a network namespace alone; a fresh
  network namespace has only a loopback interface, down, so every connect fails. Where neither is permitted
  (a container without CAP_SYS_ADMIN or user namespaces), this layer is missing and ``Execution.isolation``
  says so. (2) Always: an audit hook (PEP 578, ``sys.addaudithook``) installed before the code runs refuses
  socket connect/bind/send and starting processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``,
  ``os.posix_spawn``), which would run without the hook, and writing, removing or renaming files outside the run's
  temporary directory. The hook is best effort: code using ``ctypes`` can call libc directly; the namespace and
  the process cap stop that for the network and for processes, nothing here does for files.
- Not isolated: the file system. The code runs as the caller's user and reads what that user may read; it may
  write only where that user may, and (past the audit hook, with ``ctypes``) anywhere that user may. A new user
  namespace does not change whose files those are. Serve untrusted code as a user who owns nothing worth keeping.
- Privileges: the limits are set by the child on itself before the code runs, as hard limits. In a new user
  namespace even a root child has no capability in the parent namespace, so it cannot raise them; without
  one, code running as root could (CAP_SYS_RESOURCE): serve such environments as an unprivileged user.
The interpreter runs isolated (``-I``: no PYTHON* variables, no user site-packages) in an empty temporary
directory with a minimal environment, which is deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Runs in the child: joins its pids cgroup, limits, namespaces, audit hook, then the code. argv: cpu_s mem_bytes
# file_bytes max_processes report_fd code_path namespaces(0/1) cgroup_procs("" for none) refuse_ctypes(0/1). It
# reports how the network was isolated on report_fd. The code may write in the directory of code_path alone.
BOOTSTRAP = r"""
import os, resource, sys
cpu_s, mem, fsize, nproc, report = (int(a) for a in sys.argv[1:6])
path, namespaces, cgroup, refuse_ctypes = sys.argv[6], sys.argv[7] == "1", sys.argv[8], sys.argv[9] == "1"
if cgroup:
    with open(cgroup, "w") as procs:
        procs.write(str(os.getpid()))
else:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
code = open(path).read()
work = os.path.dirname(os.path.realpath(path)) + os.sep
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
isolation = "audit hook"
if namespaces:
    def unshare(flags):
        if hasattr(os, "unshare"):
            os.unshare(flags)
            return
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
    for flags, name in ((0x10000000 | 0x40000000, "user+network namespace"), (0x40000000, "network namespace")):
        try:
            unshare(flags)
        except OSError:
            continue
        isolation = name + " + audit hook"
        break
os.write(report, isolation.encode())
os.close(report)
REFUSED = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "subprocess.Popen", "os.system",
           "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn")
# events that change files, and how many of their first arguments are paths
CHANGES = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.truncate": 1,
           "os.chmod": 1, "os.chown": 1, "os.mkdir": 1, "os.utime": 1, "shutil.rmtree": 1}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
def outside(name, realpath=os.path.realpath, fsdecode=os.fsdecode):
    return not isinstance(name, int) and not realpath(fsdecode(name)).startswith(work)
def refuse(event, args):
    if event in REFUSED or (refuse_ctypes and event.startswith("ctypes.")):
        raise PermissionError(f"{event}: not allowed in this sandbox (no network, no new processes)")
    writes = event == "open" and args[2] & WRITE_FLAGS
    if (writes and outside(args[0])) or any(outside(a) for a in args[:CHANGES.get(event, 0)]):
        raise PermissionError(f"{event} {args[0]!r}: not allowed in this sandbox (files outside its directory)")
sys.addaudithook(refuse)
del os, resource, sys.argv[1:]
exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "killed", signal.SIGXFSZ: "output limit"}


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2  # CPU seconds
    memory_mb: int = 256  # address space
    wall_s: float = 5.0  # wall-clock seconds
    output_chars: int = 1000  # of stdout and of stderr returned
    max_output_bytes: int = 1 << 20  # written to each before SIGXFSZ
    max_processes: int = 16  # tasks (processes and threads) at once: the pids cgroup's pids.max, else RLIMIT_NPROC
    namespaces: bool = True  # try unshare(2); False: the audit hook alone (tests of that fallback)


@dataclass(frozen=True)
class Execution:
    stdout: str
    stderr: str
    exit_code: int  # the process's code, or -N when signal N ended it
    timed_out: bool  # killed at the wall-clock limit
    limit: str  # the limits it ran into ("process limit, wall time limit", "CPU time limit", ...), "" for none
    isolation: str  # how the network was cut off (module docstring)
    seconds: float
    process_cap: str = ""  # how its processes were capped (module docstring)
    forks_refused: int = 0  # forks the pids cgroup refused (0 without one)

    def as_text(self) -> str:
        """The tool result the policy reads."""
        status = f"exit code {self.exit_code}" + (f" ({self.limit})" if self.limit else "")
        parts = [status]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        return "\n".join(parts)


class PidsCgroup:
    """A pids cgroup of one run, below the caller's own (cgroup v1 ``pids`` hierarchy, or v2 with ``pids`` enabled
    for children): ``pids.max`` caps its tasks, ``pids.events`` counts the forks refused at the cap."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, max_processes: int) -> PidsCgroup | None:
        """A new cgroup capped at ``max_processes``, or None where the caller may not make one."""
        parent = cls._own()
        if parent is None:
            return None
        path = parent / f"relayrl-sandbox-{os.getpid()}-{time.monotonic_ns()}"
        try:
            path.mkdir()
        except OSError:
            return None
        cgroup = cls(path)
        try:
            (path / "pids.max").write_text(str(max_processes))
        except OSError:
            cgroup.remove()
            return None
        return cgroup

    @staticmethod
    def _own() -> Path | None:
        """The directory of this process's pids cgroup, None when there is none."""
        root = Path("/sys/fs/cgroup")
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                return root / "pids" / path.lstrip("/")
            if controllers == "" and (root / "cgroup.controllers").is_file():  # v2, unified
                own = root / path.lstrip("/")
                with contextlib.suppress(OSError):
                    if "pids" in (own / "cgroup.subtree_control").read_text().split():
                        return own
        return None

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def forks_refused(self) -> int:
        """How many forks hit ``pids.max`` (``pids.events``: ``max N``)."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        return 0

    def remove(self) -> None:
        """SIGKILL every process in it until none is left (a fork of a dying bomb is capped, so this ends), then
        remove it."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for p in self.procs.read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        data = f.read(limit * 4 + 4)
        rest = f.seek(0, os.SEEK_END) - len(data)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or rest > 0:
        return text[:limit] + "\n...[truncated]"
    return text


def _process_cap(cgroup: PidsCgroup | None, max_processes: int) -> str:
    if cgroup is not None:
        return f"pids cgroup (pids.max {max_processes})"
    if os.geteuid() != 0:
        return f"RLIMIT_NPROC {max_processes} (all of this user's processes)"
    return "audit hook alone (root without a pids cgroup: RLIMIT_NPROC does not bind; ctypes refused)"


def run_python(code: str, limits: Limits = Limits()) -> Execution:
    """Run ``code`` under ``limits`` and wait for it (at most ``wall_s`` plus the time to kill it)."""
    started = time.monotonic()
    cgroup = PidsCgroup.create(limits.max_processes)
    refuse_ctypes = cgroup is None and os.geteuid() == 0
    try:
        with tempfile.TemporaryDirectory(prefix="relayrl-sandbox-") as tmp:
            work = Path(tmp)
            (work / "code.py").write_text(code)
            out, err = work / "stdout", work / "stderr"
            read_report, write_report = os.pipe()
            argv = [
                sys.executable, "-I", "-B", "-c", BOOTSTRAP,
                str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.max_output_bytes),
                str(limits.max_processes), str(write_report), str(work / "code.py"),
                "1" if limits.namespaces else "0", str(cgroup.procs) if cgroup else "", "1" if refuse_ctypes else "0",
            ]  # fmt: skip
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=tmp,
                                        env=env, pass_fds=(write_report,), start_new_session=True)  # fmt: skip
            os.close(write_report)
            timed_out, forks_refused = False, 0
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the code's own children too
                proc.wait()
                if cgroup is not None:
                    forks_refused = cgroup.forks_refused()
                    cgroup.remove()  # and any that left the process group
            with os.fdopen(read_report, "rb") as report:
                isolation = report.read().decode() or "none (the sandbox did not start)"
            ended = "wall time limit" if timed_out else SIGNALS.get(-proc.returncode, "") if proc.returncode < 0 else ""
            limit = ", ".join(name for name in ("process limit" if forks_refused else "", ended) if name)
            return Execution(
                stdout=_read(out, limits.output_chars),
                stderr=_read(err, limits.output_chars),
                exit_code=proc.returncode,
                timed_out=timed_out,
                limit=limit,
                isolation=isolation,
                seconds=time.monotonic() - started,
                process_cap=_process_cap(cgroup, limits.max_processes),
                forks_refused=forks_refused,
            )
    finally:
        if cgroup is not None:
            cgroup.remove()
