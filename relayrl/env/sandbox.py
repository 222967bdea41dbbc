"""Run untrusted Python code in a separate process under resource limits (the ``run_python`` tool).

What is enforced, and where:
- CPU time: ``RLIMIT_CPU`` (soft ``cpu_s``: SIGXCPU ends the process; hard ``cpu_s + 1``: SIGKILL).
- Memory: ``RLIMIT_AS`` (``memory_mb`` of address space): an allocation past it fails (Python: MemoryError).
- Output: stdout and stderr go to files capped by ``RLIMIT_FSIZE`` (``max_output_bytes``: SIGXFSZ past it); the
  caller reads back at most ``output_chars`` of each.
- Wall time: the caller kills the process group (the code and anything it started) after ``wall_s``.
- No network, two layers. (1) Namespaces: the child unshares a new user + network namespace (unshare(2), via
  ``os.unshare`` where Python has it (3.12+), else libc through ctypes), else a network namespace alone; a fresh
  network namespace has only a loopback interface, down, so every connect fails. Where neither is permitted
  (a container without CAP_SYS_ADMIN or user namespaces), this layer is missing and ``Execution.isolation``
  says so. (2) Always: an audit hook (PEP 578, ``sys.addaudithook``) installed before the code runs refuses
  socket connect/bind/send and starting processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``,
  ``os.posix_spawn``), which would run without the hook. The hook is best effort: code using ``ctypes`` can
  call libc directly; only the namespace layer stops that.
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

# Runs in the child: limits, namespaces, audit hook, then the code. argv: cpu_s mem_bytes file_bytes report_fd
# code_path namespaces(0/1). It reports how the network was isolated on report_fd.
BOOTSTRAP = r"""
import os, resource, sys
cpu_s, mem, fsize, report = (int(a) for a in sys.argv[1:5])
path, namespaces = sys.argv[5], sys.argv[6] == "1"
code = open(path).read()
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
def refuse(event, args):
    if event in REFUSED:
        raise PermissionError(f"{event}: not allowed in this sandbox (no network, no new processes)")
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
    namespaces: bool = True  # try unshare(2); False: the audit hook alone (tests of that fallback)


@dataclass(frozen=True)
class Execution:
    stdout: str
    stderr: str
    exit_code: int  # the process's code, or -N when signal N ended it
    timed_out: bool  # killed at the wall-clock limit
    limit: str  # which limit ended it ("CPU time limit", "wall time limit", ...), "" for none
    isolation: str  # how the network was cut off (module docstring)
    seconds: float

    def as_text(self) -> str:
        """The tool result the policy reads."""
        status = f"exit code {self.exit_code}" + (f" ({self.limit})" if self.limit else "")
        parts = [status]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        return "\n".join(parts)


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        data = f.read(limit * 4 + 4)
        rest = f.seek(0, os.SEEK_END) - len(data)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or rest > 0:
        return text[:limit] + "\n...[truncated]"
    return text


def run_python(code: str, limits: Limits = Limits()) -> Execution:
    """Run ``code`` under ``limits`` and wait for it (at most ``wall_s`` plus the time to kill it)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relayrl-sandbox-") as tmp:
        work = Path(tmp)
        (work / "code.py").write_text(code)
        out, err = work / "stdout", work / "stderr"
        read_report, write_report = os.pipe()
        argv = [
            sys.executable, "-I", "-c", BOOTSTRAP,
            str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.max_output_bytes), str(write_report),
            str(work / "code.py"), "1" if limits.namespaces else "0",
        ]  # fmt: skip
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp}
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=tmp, env=env,
                                    pass_fds=(write_report,), start_new_session=True)  # fmt: skip
        os.close(write_report)
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the code's own children too
            proc.wait()
        with os.fdopen(read_report, "rb") as report:
            isolation = report.read().decode() or "none (the sandbox did not start)"
        limit = "wall time limit" if timed_out else SIGNALS.get(-proc.returncode, "") if proc.returncode < 0 else ""
        return Execution(
            stdout=_read(out, limits.output_chars),
            stderr=_read(err, limits.output_chars),
            exit_code=proc.returncode,
            timed_out=timed_out,
            limit=limit,
            isolation=isolation,
            seconds=time.monotonic() - started,
        )
