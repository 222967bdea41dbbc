"""RepeatedWarning: a warning that recurs is logged at its 1st, (every+1)th, ... occurrence, with its count, per key."""

from __future__ import annotations

import logging

import pytest

from relayrl.runtime.repeats import RepeatedWarning


def test_each_key_is_logged_once_every_n_with_its_count(caplog):
    repeats = RepeatedWarning(logging.getLogger("test.repeats"), every=3)
    with caplog.at_level("WARNING", logger="test.repeats"):
        logged = [repeats.warn("a", "slow %s", "a") for _ in range(7)] + [repeats.warn("b", "slow %s", "b")]
    assert logged == [True, False, False, True, False, False, True, True]
    assert [r.getMessage() for r in caplog.records] == [
        "slow a",
        "slow a [4 times so far; logged once every 3]",
        "slow a [7 times so far; logged once every 3]",
        "slow b",
    ]


def test_a_period_below_one_is_refused():
    with pytest.raises(ValueError, match="every: must be >= 1"):
        RepeatedWarning(logging.getLogger("test.repeats"), every=0)
