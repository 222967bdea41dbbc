"""The prompt ledger's events: terminal states never change, and a trained group's per-token version accounting."""

from __future__ import annotations

import json
import subprocess
import sys

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


def written(path, states: list[tuple[str, str]]) -> str:
    """A ledger file with one event per (id, state), as the controller writes them."""
    ledger = Ledger(path)
    for pid, state in states:
        ledger.mark([pid], state, step=1)
    ledger.close()
    return path.read_text()


def test_a_failed_write_is_cut_back_and_leaves_memory_as_the_log_is(tmp_path, monkeypatch):
    """A write that fails half-way (ENOSPC after some bytes) is truncated to the last whole event and the state
    in memory does not change; the next events append cleanly and a restart replays exactly what memory held."""
    import errno
    import os

    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.mark(["a", "b"], QUEUED)
    good = path.read_bytes()
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ledger.mark(["a", "b"], TRAINED, step=1)
    with pytest.raises(OSError, match="No space left"):
        ledger.rewind(["a"], "rolled back")
    monkeypatch.setattr(os, "write", real_write)
    assert path.read_bytes() == good
    assert ledger.state("a") == (QUEUED, "", -1) and ledger.state("b") == (QUEUED, "", -1)
    ledger.mark(["a"], TRAINED, step=2)
    ledger.close()
    again = Ledger(path)
    assert again.torn_tails == 0
    assert again.state("a") == (TRAINED, "", 2) and again.state("b") == (QUEUED, "", -1)


def test_a_torn_last_line_is_cut_noted_and_counted_and_the_log_goes_on(tmp_path, caplog):
    """A crash, a full disk or a lost host cuts the last line (``{"id": "p2", "state": "trai``): replay cuts it
    off (WARNING naming the file and line), notes the cut in the log and counts it; the next event starts a line
    of its own, and a second replay sees the same state and the same count."""
    path = tmp_path / "ledger.jsonl"
    whole = written(path, [("p1", QUEUED), ("p1", TRAINED)])
    path.write_text(whole + '{"id": "p2", "state": "trai')
    with caplog.at_level("WARNING", logger="relayrl.controller.ledger"):
        ledger = Ledger(path)
    assert f"{path}:3: torn last line cut" in caplog.text
    assert ledger.torn_tails == 1 and ledger.state("p1") == (TRAINED, "", 1) and ledger.state("p2") is None
    ledger.mark(["p2"], QUEUED, step=2)
    ledger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # every line whole again
    assert lines[2] == {"note": "torn tail cut", "line": 3, "bytes": len('{"id": "p2", "state": "trai')}
    again = Ledger(path)
    assert again.torn_tails == 1 and again.state("p2") == (QUEUED, "", 2)


def test_a_whole_last_event_without_its_newline_is_kept_and_the_next_starts_a_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text(written(path, [("p1", QUEUED)]).removesuffix("\n"))
    ledger = Ledger(path)
    ledger.mark(["p2"], QUEUED)
    ledger.close()
    assert Ledger(path).torn_tails == 0 and [json.loads(line)["id"] for line in path.read_text().splitlines()] == [
        "p1",
        "p2",
    ]


@pytest.mark.parametrize("bad", ['{"id": "p2", "state": "trai', "[1, 2]", "\0\0\0"])
def test_a_corrupt_line_before_the_last_is_refused_naming_the_file_and_line(tmp_path, bad):
    path = tmp_path / "ledger.jsonl"
    lines = written(path, [("p1", QUEUED), ("p3", QUEUED)]).splitlines(keepends=True)
    path.write_text(lines[0] + bad + "\n" + lines[1])
    with pytest.raises(LedgerError) as err:
        Ledger(path)
    assert str(err.value).startswith(f"{path}:2: corrupt ledger line") and "\n" not in str(err.value)


def test_a_controller_on_a_ledger_with_a_corrupt_middle_line_exits_2_with_one_line_naming_it(make_config, tmp_path):
    """``relayrl controller serve`` as a user (or the supervisor) starts it: exit 2, one stderr line that names the
    file and the line (a damaged file needs a person, not a traceback)."""
    state = tmp_path / "state"
    state.mkdir()
    ledger = state / "ledger.jsonl"
    ledger.write_text('{"id": "p1", "state": "queued"}\n{"id": "p2", "sta\n{"id": "p3", "state": "queued"}\n')
    argv = [sys.executable, "-m", "relayrl.cli", "--log-level", "error", "controller", "serve"]
    argv += ["--config", str(make_config()), "--state-dir", str(state), "--port", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert lines[0].startswith(f"relayrl: {ledger}:2: corrupt ledger line"), lines
