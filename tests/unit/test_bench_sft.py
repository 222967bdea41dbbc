"""``relayrl bench sft``'s data (relayrl/bench/sft.py text_rows): variable lengths within the bounds asked, many short
rows and a few long ones, the same rows for the same seed (both sides of the bench read one file); the timed figures
of a side's steps (relayrl/bench/versus_trl.py step_figures)."""

from __future__ import annotations

import pytest

from relayrl.bench.sft import text_rows
from relayrl.bench.versus_trl import step_figures


def test_text_rows_are_long_tailed_within_their_bounds_and_seeded() -> None:
    rows = text_rows(400, 8, 300, seed=0)
    words = [len(row["text"].split()) for row in rows]
    assert min(words) >= 8 and max(words) <= 300
    assert sum(w <= 50 for w in words) > sum(w > 150 for w in words) > 0  # log-uniform: short rows outnumber long
    assert text_rows(400, 8, 300, seed=0) == rows and text_rows(400, 8, 300, seed=1) != rows


def test_step_figures_leave_out_the_first_step_and_take_the_median_of_the_rest() -> None:
    """One slowed step moves the summed tokens/s, not the median of the steps' own (a shared machine's noise)."""
    figures = step_figures([(9.0, 50), (1.0, 100), (2.0, 100), (10.0, 100)])
    assert figures["timed_tokens"] == 300 and figures["timed_seconds"] == 13.0
    assert figures["tokens_per_s"] == 300 / 13.0
    assert figures["median_step_tokens_per_s"] == 50.0
    assert figures["step_seconds"] == [9.0, 1.0, 2.0, 10.0]
    with pytest.raises(ValueError, match="steps: 1 step"):
        step_figures([(1.0, 10)])
