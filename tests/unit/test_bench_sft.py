"""``relayrl bench sft``'s data (relayrl/bench/sft.py text_rows): variable lengths within the bounds asked, many short
rows and a few long ones, the same rows for the same seed (both sides of the bench read one file)."""

from __future__ import annotations

from relayrl.bench.sft import text_rows


def test_text_rows_are_long_tailed_within_their_bounds_and_seeded() -> None:
    rows = text_rows(400, 8, 300, seed=0)
    words = [len(row["text"].split()) for row in rows]
    assert min(words) >= 8 and max(words) <= 300
    assert sum(w <= 50 for w in words) > sum(w > 150 for w in words) > 0  # log-uniform: short rows outnumber long
    assert text_rows(400, 8, 300, seed=0) == rows and text_rows(400, 8, 300, seed=1) != rows
