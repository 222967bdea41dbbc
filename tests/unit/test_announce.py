"""Ready lines of processes that share one stdout pipe stay whole (``announce``, relayrl/runtime/procs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

WRITERS, LINES = 4, 3000


def lines_through_one_pipe(code: str) -> list[str]:
    """Run ``code`` (it writes LINES lines naming ``sys.argv[1]``) in WRITERS processes sharing one pipe, as
    the servers of one ``relayrl env serve --processes N`` share theirs, with PYTHONUNBUFFERED set as under CI."""
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)], stdout=write_end, env=env) for k in range(WRITERS)]
    os.close(write_end)
    out = b""
    while chunk := os.read(read_end, 1 << 16):
        out += chunk
    os.close(read_end)
    assert all(proc.wait(timeout=60) == 0 for proc in procs)
    return out.decode().splitlines()


def test_announced_lines_of_processes_sharing_a_pipe_never_interleave() -> None:
    lines = lines_through_one_pipe(
        "import sys\nfrom relayrl.runtime.procs import announce\n"
        f"for i in range({LINES}): announce(f'server {{sys.argv[1]}} line {{i}}')"
    )
    assert sorted(lines) == sorted(f"server {k} line {i}" for k in range(WRITERS) for i in range(LINES))
