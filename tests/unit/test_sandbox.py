"""The sandbox (relayrl/runtime/sandbox.py) kills or refuses what untrusted code may try: a CPU loop, a memory hog,
a fork bomb (through Python and past its audit hook), sleeping forever, the network, files outside its directory;
and it says each time which limit it was."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from relayrl.runtime.sandbox import Limits, PidsCgroup, run_python

# connect(2) through libc, past Python's audit hook: only a network namespace stops it
LIBC_CONNECT = """
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
addr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
print("connected" if libc.connect(fd, addr, len(addr)) == 0 else f"errno {{ctypes.get_errno()}}")
"""


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        yield server


def nobody_connected(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except TimeoutError:
        return True
    return False


def test_code_runs_and_its_output_comes_back_truncated() -> None:
    run = run_python("import math\nprint(math.factorial(10))\nprint('oops', file=__import__('sys').stderr)")
    assert (run.stdout, run.stderr, run.exit_code, run.limit) == ("3628800\n", "oops\n", 0, "")
    assert run.as_text() == "exit code 0\nstdout:\n3628800\n\nstderr:\noops\n"
    long = run_python("print('x' * 5000)", Limits(output_chars=100))
    assert long.stdout == "x" * 100 + "\n...[truncated]"


def test_a_cpu_loop_is_killed_at_the_cpu_limit() -> None:
    run = run_python("while True:\n    pass", Limits(cpu_s=1, wall_s=60))
    assert (run.exit_code, run.limit, run.timed_out) == (-24, "CPU time limit", False)  # SIGXCPU


def test_a_memory_bomb_is_refused() -> None:
    run = run_python("blocks = [bytearray(1 << 30)]", Limits(memory_mb=128))
    assert run.exit_code == 1 and run.stderr.rstrip().endswith("MemoryError")


def test_sleeping_hits_the_wall_clock_limit() -> None:
    run = run_python("import time\ntime.sleep(60)", Limits(wall_s=1))
    assert (run.timed_out, run.limit, run.exit_code) == (True, "wall time limit", -9)


def test_the_code_cannot_raise_its_limits() -> None:
    run = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))")
    assert run.exit_code == 1 and "ValueError: not allowed to raise maximum limit" in run.stderr


@pytest.mark.parametrize("namespaces", [True, False])
def test_network_and_new_processes_are_refused(listener, namespaces: bool) -> None:
    port = listener.getsockname()[1]
    limits = Limits(namespaces=namespaces)
    run = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", limits)
    assert "PermissionError: socket.connect: not allowed in this sandbox" in run.stderr
    spawn = run_python("import subprocess\nsubprocess.run(['true'])", limits)
    assert "PermissionError: subprocess.Popen: not allowed" in spawn.stderr
    assert nobody_connected(listener)
    assert run.isolation.endswith("audit hook") and (namespaces or run.isolation == "audit hook")


def test_the_network_namespace_stops_what_the_audit_hook_cannot(listener) -> None:
    port = listener.getsockname()[1]
    run = run_python(LIBC_CONNECT.format(port=port))
    if "namespace" in run.isolation:
        assert run.stdout.strip() == "errno 101"  # ENETUNREACH: a fresh namespace's loopback is down
        assert nobody_connected(listener)
    else:  # unshare(2) not permitted: the audit hook alone, which ctypes passes unless it refuses ctypes (root)
        assert run.isolation == "audit hook"
        assert run.stdout.strip() == "connected" or "ctypes.dlopen: not allowed" in run.stderr


def test_a_fork_bomb_through_python_is_refused_by_the_audit_hook() -> None:
    run = run_python("import os\nwhile True:\n    os.fork()", Limits(wall_s=3))
    assert run.exit_code == 1 and "PermissionError: os.fork: not allowed in this sandbox" in run.stderr
    assert run.forks_refused == 0 and not run.timed_out


# fork(2) through libc, past the audit hook: every process forks for ever. Contained by the process cap (a pids
# cgroup as root here, RLIMIT_NPROC as any other user) and ended at the wall limit; as root without a cgroup the
# sandbox refuses ctypes instead, so it never starts
LIBC_FORK_BOMB = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()"


def test_a_fork_bomb_past_the_audit_hook_is_capped_then_killed_and_reported() -> None:
    before = set(os.listdir(PidsCgroup._own())) if PidsCgroup._own() else set()
    run = run_python(LIBC_FORK_BOMB, Limits(max_processes=8, wall_s=2, cpu_s=2))
    if run.process_cap.startswith("pids cgroup"):
        assert run.forks_refused > 0 and run.limit == "process limit, wall time limit"
        assert set(os.listdir(PidsCgroup._own())) == before  # its cgroup is gone: no process of it is left
    elif run.process_cap.startswith("RLIMIT_NPROC"):
        assert run.timed_out and run.limit == "wall time limit"
    else:
        assert "PermissionError: ctypes.dlopen: not allowed in this sandbox" in run.stderr


def test_files_outside_the_sandbox_directory_are_not_changed(tmp_path: Path) -> None:
    outside = tmp_path / "keep.txt"
    outside.write_text("kept")
    for code in (f"open({str(outside)!r}, 'w')", f"import os\nos.remove({str(outside)!r})"):
        run = run_python(code)
        assert run.exit_code == 1 and "not allowed in this sandbox (files outside its directory)" in run.stderr
    assert outside.read_text() == "kept"
    inside = run_python("open('scratch.txt', 'w').write('x')\nimport tempfile\nprint(tempfile.mkstemp()[0] > 0)")
    assert (inside.exit_code, inside.stdout) == (0, "True\n")
