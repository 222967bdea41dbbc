"""Fault points (relayrl/runtime/faults.py): the only place the product reads RELAYRL_FAULT*, off unless armed,
once with RELAYRL_FAULT_ONCE, and the ledger's point leaves a torn last line that a restart cuts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from relayrl.controller.ledger import QUEUED, Ledger
from relayrl.runtime import faults

PACKAGE = Path(faults.__file__).resolve().parents[1]


def test_only_the_fault_point_module_reads_the_fault_variables():
    readers = sorted(
        str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py") if "RELAYRL_FAULT" in path.read_text()
    )
    assert readers == ["relayrl/runtime/faults.py"]


def test_a_point_fires_only_for_its_armed_key_and_once_with_a_marker(tmp_path, monkeypatch):
    assert not faults.armed("rollout.load", "rollout-1/5")  # not armed: nothing
    monkeypatch.setenv(faults.ARM, "rollout.load@rollout-1/5")
    assert not faults.armed("rollout.load", "rollout-0/5") and not faults.armed("ledger.write", "rollout-1/5")
    assert faults.armed("rollout.load", "rollout-1/5") and faults.armed("rollout.load", "rollout-1/5")
    monkeypatch.setenv(faults.ONCE, str(tmp_path / "fired"))
    assert faults.armed("rollout.load", "rollout-1/5")
    assert not faults.armed("rollout.load", "rollout-1/5")  # a restarted role with the same environment lives


def test_the_ledger_write_point_dies_mid_write_and_a_restart_cuts_the_torn_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    code = (
        f"from relayrl.controller.ledger import Ledger; Ledger({str(path)!r}).mark(['a', 'b', 'c'], 'queued', step=3)"
    )
    env = {**os.environ, faults.ARM: "ledger.write@queued/3"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == faults.EXIT_CODE, run.stderr
    assert "fault point ledger.write" in run.stderr
    torn = path.read_text()
    assert torn and not torn.endswith("\n")  # half of the three events' bytes
    ledger = Ledger(path)
    assert ledger.torn_tails == 1 and ledger.state("a") == (QUEUED, "", 3) and ledger.state("b") is None
    ledger.mark(["b"], QUEUED, step=3)
    assert ledger.state("b") == (QUEUED, "", 3)
