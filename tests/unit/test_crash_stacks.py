"""A role that dies of a native crash leaves every thread's Python stack in its log (relayrl.cli.main enables
faulthandler): a trainer once aborted at start with only glibc's one line ("malloc_consolidate(): unaligned fastbin
chunk detected") to go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_role_aborted_by_a_native_crash_logs_each_threads_python_stack(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "relayrl.cli", "controller", "serve", "--config", str(ROOT / "examples/digits.yaml")]
    argv += ["--port", "0", "--set", f"run.dir={tmp_path / 'runs'}"]
    role = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "controller listening on port" in role.stdout.readline()
        os.kill(role.pid, signal.SIGABRT)  # what glibc raises when its heap checks fail
        _, stderr = role.communicate(timeout=60)
    finally:
        role.kill()
    assert role.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in stderr, stderr[-3000:]
    assert "Current thread" in stderr and "in wait_for_shutdown" in stderr, stderr[-3000:]
