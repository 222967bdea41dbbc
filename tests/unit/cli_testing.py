"""``relayrl`` commands run in the test process (``relayrl_run``) or as a process of their own
(``relayrl_process``), and the one-line refusal both must give: test_cli_refusals.py, offline_testing.py (train)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def relayrl_run(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``relayrl ARGV`` in this process, as ``python -m relayrl.cli ARGV`` runs it (``relayrl.cli.main``), in ``cwd``
    with ``env`` added to the environment: (exit code, stdout, stderr). A refusal comes before anything starts, so
    a process of its own only repeats the imports; the role commands (their process set-up: relayrl.runtime.heap,
    gcfreeze) and `up` past its light checks (it starts its fork server) run as processes (``relayrl_process``)."""
    from relayrl import cli

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if cwd is not None:
            patch.chdir(cwd)
        for key, value in {"PYTHONPATH": str(ROOT), **(env or {})}.items():
            patch.setenv(key, value)
        try:
            code = cli.main(list(argv))
        except SystemExit as done:  # argparse's refusals, as the interpreter exits with them
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    return code, out.getvalue(), err.getvalue()


def one_line(code: int, stdout: str, stderr: str) -> str:
    """Asserts exit code 2 and exactly one line on stderr, and returns that line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, stderr[-3000:], stdout[-1000:])
    return lines[0]


def relayrl(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """``relayrl ARGV`` refused (``relayrl_run``): its one stderr line."""
    return one_line(*relayrl_run(*argv, cwd=cwd, env=env))


def relayrl_process(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """``relayrl ARGV`` refused as a process of its own (``python -m relayrl.cli``): its one stderr line."""
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    return one_line(done.returncode, done.stdout, done.stderr)
