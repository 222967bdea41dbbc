"""``relayrl env serve --processes N``: N environment server processes on consecutive ports.

Sessions live in the memory of the process that answered their Reset, so the pool is N addresses
(``host:port`` .. ``host:port+N-1``), not one: list them all in ``environment.servers`` and a caller keeps each
episode on the server that reset it. Each server is its own OS process (``relayrl env serve ... --processes 1``,
stopped with this one); CPU-bound environments get a core each. Every port is checked before any process
starts. A server that exits stops the pool (exit 1), for the process manager above to restart it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from relayrl.runtime.forkserver import RELAY
from relayrl.runtime.ports import port_in_use
from relayrl.runtime.procs import PARENT_ENV

log = logging.getLogger(__name__)


def busy_ports(host: str, ports: list[int]) -> list[str]:
    """``"host:port (why)"`` for each port that cannot be bound now (port 0 is never busy)."""
    out = []
    for port in ports:
        if port and (why := port_in_use(host, port)):
            out.append(f"{host}:{port} ({why})")
    return out


def pool_ports(port: int, processes: int) -> list[int]:
    """The ports of a pool: ``port`` .. ``port + processes - 1``; all 0 (each picks a free one) for port 0."""
    return [port + i if port else 0 for i in range(processes)]


def run_pool(server_args: list[str], ports: list[int]) -> int:
    """Start one ``relayrl env serve <server_args> --port P --processes 1`` per port and wait: until SIGTERM or
    SIGINT (stop them all, exit 0) or until one exits (stop the rest, exit 1)."""
    stop: list[str] = []

    def on_signal(signum, _frame) -> None:
        stop.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    env = {**os.environ, PARENT_ENV: str(os.getpid())}  # each server stops when the pool dies
    children = [
        subprocess.Popen([*RELAY, "env", "serve", *server_args, "--port", str(port), "--processes", "1"], env=env)
        for port in ports
    ]
    code = 0
    while not stop:
        dead = [(i, c.returncode) for i, c in enumerate(children) if c.poll() is not None]
        if dead:
            log.error("environment server %d exited with code %s: stopping the pool", dead[0][0], dead[0][1])
            code = 1
            break
        time.sleep(0.2)
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return code
