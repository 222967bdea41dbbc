"""``relayrl env serve`` as real processes: a pool of two servers, episodes on each, a busy port, a bad name."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from relayrl.env import EnvironmentClient
from relayrl.env.examples.guess import secret_for
from relayrl.runtime.ports import free_port, port_in_use
from relayrl.runtime.procs import descendants, kill_tree

GUESS = "relayrl.env.examples.guess:GuessNumber"
RELAY = [sys.executable, "-m", "relayrl.cli"]


def consecutive_free_ports(count: int) -> int:
    for _ in range(100):
        first = free_port()
        if all(port_in_use("127.0.0.1", first + i) is None for i in range(count)):
            return first
    raise AssertionError("no consecutive free ports")


def read_lines(proc: subprocess.Popen, count: int, timeout_s: float = 60) -> list[str]:
    lines, selector = [], selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while len(lines) < count and time.monotonic() < deadline:
        if selector.select(timeout=0.5):
            line = proc.stdout.readline()
            assert line, f"the pool exited ({proc.poll()}) after {lines}"
            lines.append(line.strip())
    assert len(lines) == count, f"got {lines} within {timeout_s}s"
    return lines


def play(address: str, session_id: str, seed: int) -> int:
    """A binary-search episode over gRPC; returns its turns."""
    env = EnvironmentClient(address, timeout_s=10)
    env.reset(session_id, {}, seed)
    low, high = 1, 8
    for turn in range(1, 5):
        mid = (low + high) // 2
        step = env.step(session_id, {"role": "assistant", "content": f"{mid}"})
        reply = step.observations[0]["content"]
        if step.done:
            assert (reply, step.reward, mid) == ("correct", 1.0, secret_for(seed))
            env.close(session_id)
            return turn
        low, high = (mid + 1, high) if reply == "higher" else (low, mid - 1)
    raise AssertionError("binary search did not finish in 4 turns")


def test_a_pool_of_two_processes_serves_episodes_and_stops_on_sigterm() -> None:
    port = consecutive_free_ports(2)
    pool = subprocess.Popen(
        [*RELAY, "env", "serve", GUESS, "--port", str(port), "--processes", "2", "--max-sessions", "4"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RELAYRL_LOG_LEVEL": "WARNING"},
    )
    try:
        lines = sorted(read_lines(pool, 2))
        assert lines == [f"environment guess-number listening on 127.0.0.1:{port + i}" for i in range(2)]
        servers = descendants(pool.pid)
        assert len(servers) == 2  # each server its own OS process
        seeds = [s for s in range(50) if secret_for(s) != 4][:2]  # not found by the first guess
        turns = [play(f"127.0.0.1:{port + i}", f"same-id-{seed}", seed) for i in range(2) for seed in seeds]
        assert min(turns) >= 2
        assert EnvironmentClient(f"127.0.0.1:{port}", timeout_s=5).info() == {
            "name": "guess-number",
            "max_sessions": 4,
            "sessions": 0,
        }
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=30) == 0
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in servers)
    finally:
        kill_tree(pool.pid)
        pool.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_busy_port_is_one_line_and_exit_2() -> None:
    port = consecutive_free_ports(2)
    holder = subprocess.Popen(
        [*RELAY, "env", "serve", GUESS, "--port", str(port + 1)], stdout=subprocess.PIPE, text=True
    )
    try:
        read_lines(holder, 1)
        busy = subprocess.run(
            [*RELAY, "env", "serve", GUESS, "--port", str(port), "--processes", "2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == 2
        assert busy.stderr.strip().splitlines() == [
            f"relayrl env serve: port in use: 127.0.0.1:{port + 1} (Address already in use)"
        ]
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=30)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("relayrl.env.examples.guess", "expected module:Class"),
        ("relayrl.env.examples.nothing:X", "cannot be imported: no module named 'relayrl.env.examples.nothing' on"),
        ("relayrl.env.examples.guess:secret_for", "secret_for is not a relayrl.env.Environment subclass"),
    ],
)
def test_a_bad_environment_name_is_a_config_error(spec: str, message: str) -> None:
    result = subprocess.run([*RELAY, "env", "serve", spec], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
