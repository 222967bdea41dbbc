"""The prompt ledger's events: terminal states never change, and a trained group's per-token version accounting."""

from __future__ import annotations

import json

import pytest

from relayrl.controller.ledger import FILTERED, QUEUED, TRAINED, Ledger, LedgerError


def test_trained_events_carry_each_groups_tokens_per_version_and_replay(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.mark(["a", "b"], QUEUED)
    ledger.mark(["a", "b"], TRAINED, step=4, token_versions={"a": {3: 10, 2: 5}, "b": {3: 7}})
    ledger.close()
    trained = [json.loads(line) for line in path.read_text().splitlines()][-2:]
    assert trained == [
        {"id": "a", "state": "trained", "reason": "", "step": 4, "token_versions": {"2": 5, "3": 10}},
        {"id": "b", "state": "trained", "reason": "", "step": 4, "token_versions": {"3": 7}},
    ]
    again = Ledger(path)
    assert again.state("a") == (TRAINED, "", 4)
    with pytest.raises(LedgerError, match="already trained"):
        again.mark(["a"], FILTERED)
