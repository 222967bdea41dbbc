"""``relayrl bench dpo``'s data and TRL modes (relayrl/bench/dpo.py): TRL-format preference rows whose texts have
long-tailed lengths within the bounds asked, the same rows for the same seed (both sides read one file), and TRL's
two modes holding as many pairs a step as relayrl's steps."""

from __future__ import annotations

from relayrl.bench.dpo import preference_rows, trl_modes
from relayrl.data.trl_formats import PREFERENCE, detect_format


def test_preference_rows_are_trl_pairs_of_long_tailed_texts_and_seeded() -> None:
    rows = preference_rows(300, 8, 150, seed=0)
    assert detect_format(list(rows[0]), rows[0]).kind == PREFERENCE
    for column in ("prompt", "chosen", "rejected"):
        words = [len(row[column].split()) for row in rows]
        assert min(words) >= 8 and max(words) <= 150
        assert sum(w <= 30 for w in words) > sum(w > 80 for w in words) > 0  # log-uniform: short texts outnumber long
    assert all(row["chosen"].startswith(" ") and row["rejected"].startswith(" ") for row in rows)
    assert any(row["chosen"] != row["rejected"] for row in rows)
    assert preference_rows(300, 8, 150, seed=0) == rows and preference_rows(300, 8, 150, seed=1) != rows


def test_trl_modes_take_relayrls_pairs_per_step_in_one_forward_or_one_a_forward() -> None:
    modes = trl_modes({"examples_per_step": 3.6})
    assert modes == {"padded": {"batch_size": 4}, "per-pair": {"batch_size": 1, "accumulate": 4}}
    assert trl_modes({"examples_per_step": 0.4})["padded"] == {"batch_size": 1}
