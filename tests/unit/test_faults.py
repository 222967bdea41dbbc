"""Fault points (relayrl/runtime/faults.py): the only place the product reads RELAYRL_FAULT*, off unless armed,
once with RELAYRL_FAULT_ONCE."""

from __future__ import annotations

from pathlib import Path

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
