"""One live run per run directory (issue 36, item 9), through real ``relayrl up`` processes: a second ``up`` of a
live run, fresh or ``--resume``, is refused in one line naming the owner and leaves the run alone; once the owner
is killed outright (its process group, as a crash takes it), ``up --resume`` takes the lock over, and a run that
ended leaves no lock file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from relayrl.config import load_config
from relayrl.runtime.runlock import RunLock

from .jobs import contiguous_records, finish, wait_steps

pytestmark = pytest.mark.slow


def up(config, *extra: str) -> subprocess.Popen:
    """``relayrl up CONFIG EXTRA...`` in its own session (its process group: the one a crash takes)."""
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(config), *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def refused_line(config, *extra: str) -> str:
    """A second ``relayrl up`` of ``config``: asserted to exit 3 with one stderr line, which is returned."""
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(config), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1, (done.returncode, done.stderr)
    return lines[0]


@pytest.mark.timeout(900)
def test_a_second_up_is_refused_naming_the_owner_and_a_killed_owners_lock_is_taken_over(make_config):
    steps = 12  # the refusals come while it trains (a finished run would refuse --resume for its steps)
    config = make_config("locked", trainer={"steps": steps, "checkpoint_every": 1})
    cfg = load_config(config)
    owner = f"pid {{}} on {socket.gethostname()} since "
    first = up(config)
    try:
        wait_steps(cfg, 1)
        for extra in ((), ("--resume",)):
            line = refused_line(config, *extra)
            assert line.startswith(f"relayrl: run {cfg.run_dir} is held by {owner.format(first.pid)}"), line
        assert not list(cfg.run_dir.parent.glob("locked.*"))  # nothing moved aside
        code, err = finish(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert code == 0, err
    contiguous_records(cfg, steps)  # the first run intact: each step once

    # a crash: the owner's whole process group killed outright; its roles stop on their own (PR_SET_PDEATHSIG)
    crashed = up(config, "--resume", "--set", f"trainer.steps={steps + 8}")
    try:
        wait_steps(cfg, steps + 1)
    finally:
        os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait()
    resumed = up(config, "--resume", "--set", f"trainer.steps={steps + 8}")  # waits for them, then takes over
    code, err = finish(resumed)
    assert code == 0, err
    contiguous_records(cfg, steps + 8)  # it took the lock over (else it was refused, exit 3)
    assert not RunLock.path_for(cfg.run_dir).exists()  # and, its run over, left no lock file behind
