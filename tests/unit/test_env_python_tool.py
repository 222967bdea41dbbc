"""The run_python sandbox's limits (CPU, memory, wall time, network, processes) and the PythonTool episode."""

from __future__ import annotations

import socket

import pytest

from relayrl.env import LocalEnvironmentClient
from relayrl.env.examples.python_tool import PythonTool, arithmetic_tasks, contains_answer
from relayrl.env.sandbox import Limits, run_python

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
    if "namespace" not in run.isolation:
        pytest.skip(f"unshare(2) is not permitted here ({run.isolation}): only the audit hook isolates")
    assert run.stdout.strip() == "errno 101"  # ENETUNREACH: a fresh namespace's loopback is down
    assert nobody_connected(listener)


def test_an_episode_with_the_tool_then_the_answer() -> None:
    task = {"question": "What is 317 * 29?", "answer": "9193"}
    with LocalEnvironmentClient(PythonTool, timeout_s=30) as env:
        opening = env.reset("s", task, 0)
        assert opening.messages[1]["content"] == "What is 317 * 29?"
        assert opening.tools[0]["function"]["name"] == "run_python"
        call = {
            "id": "c0",
            "type": "function",
            "function": {"name": "run_python", "arguments": {"code": "print(317*29)"}},
        }
        tool = env.step("s", {"role": "assistant", "content": "", "tool_calls": [call]})
        assert tool.observations == [
            {"role": "tool", "content": "exit code 0\nstdout:\n9193\n", "tool_call_id": "c0", "name": "run_python"}
        ]
        assert not tool.done and tool.metrics["tool_calls"] == 1.0
        final = env.step("s", {"role": "assistant", "content": "317 * 29 = 9193."})
        assert (final.done, final.reward, final.observations) == (True, 1.0, [])
        env.reset("wrong", task, 0)
        assert env.step("wrong", {"role": "assistant", "content": "19193"}).reward == 0.0


def test_tasks_and_answer_matching() -> None:
    rows = arithmetic_tasks(5, seed=1)
    assert rows == arithmetic_tasks(5, seed=1) and len({r["question"] for r in rows}) == 5
    for row in rows:
        a, op, b = row["question"].removeprefix("What is ").rstrip("?").split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert (
        contains_answer("so it is 42.", "42") and not contains_answer("420", "42") and not contains_answer("4.2", "2")
    )
