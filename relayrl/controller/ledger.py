"""The prompt ledger: every drawn prompt id ends as trained, filtered (and why) or failed (and why).

State lives in an append-only JSONL event log, replayed on start, so a restarted controller knows
every prompt's fate. Terminal states never change; a second terminal event for an id is refused.

It is replayed as a write-ahead log is. Each call's events go out in one ``write(2)`` (a killed process leaves all
or none of them); a lost host, a full disk or a short write can still cut the last line: replay cuts that torn
tail off (logged at WARNING, recorded in the log as a ``{"note": "torn tail cut", ...}`` line and counted in
``torn_tails``) and goes on. A line that is not an event anywhere else is corruption, refused with a LedgerError
naming the file and the line. A write that fails (a full disk: ENOSPC) is cut back to the last whole event before
its error is raised, and the in-memory state changes only after its events are written: memory never holds what
the log lacks, and later events never land after a partial line. ``sync()`` makes every event written so far
durable (fsync); the controller calls it at the points that need it (controller/core.py), not after each write.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

from relayrl.runtime import faults

log = logging.getLogger(__name__)
PENDING, QUEUED, TRAINED, FILTERED, FAILED = "pending", "queued", "trained", "filtered", "failed"
REWOUND = "rewound"  # an event, not a state: the run was rolled back to before this prompt was drawn
TERMINAL = frozenset({TRAINED, FILTERED, FAILED})
TORN_NOTE = "torn tail cut"


class LedgerError(RuntimeError):
    pass


class Ledger:
    """prompt id -> (state, reason, step). Thread-safe; persisted when ``path`` is given."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, str, int]] = {}
        self.torn_tails = 0  # torn last lines cut at a start over the log's life (its notes)
        self._path = Path(path) if path else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                self._replay()
            except LedgerError:
                self.close()
                raise
            self._end = os.fstat(self._fd).st_size  # bytes of whole events: where a failed write is cut back to

    def _replay(self) -> None:
        """Apply every event; cut a torn tail (then note it); refuse a bad line before the last."""
        assert self._path is not None
        lines = self._path.read_bytes().splitlines(keepends=True)
        good = 0  # bytes of whole lines so far
        for number, raw in enumerate(lines, 1):
            event = _event(raw)
            if event is None and raw.strip():
                if any(rest.strip() for rest in lines[number:]):
                    raise LedgerError(
                        f"{self._path}:{number}: corrupt ledger line (not an event: {raw[:60]!r}); only the last "
                        "line can be torn by a crash: restore the file or remove that line"
                    )
                self._cut(good, number, raw)
                return
            if event is not None:
                self._apply(event)
            good += len(raw)
        if lines and not lines[-1].endswith(b"\n"):  # a whole last event cut just before its newline
            _write_all(self._fd, b"\n")

    def _apply(self, event: dict) -> None:
        if event.get("note") == TORN_NOTE:
            self.torn_tails += 1
        elif "state" not in event:  # a note (record_episodes), not a state change
            return
        elif event["state"] == REWOUND:
            self._entries.pop(event["id"], None)
        else:
            self._entries[event["id"]] = (event["state"], event.get("reason", ""), event.get("step", -1))

    def _cut(self, good: int, number: int, raw: bytes) -> None:
        """Truncate the torn last line (so the next event starts a line of its own) and note the cut."""
        assert self._path is not None
        log.warning(
            "%s:%d: torn last line cut (%d bytes: %r): a write the controller did not finish (its events are "
            "dropped; a reported step's prompts are settled again from its batch file)",
            self._path, number, len(raw), raw[:60],
        )  # fmt: skip
        os.ftruncate(self._fd, good)
        self._end = good
        self.torn_tails += 1
        self._append([{"note": TORN_NOTE, "line": number, "bytes": len(raw)}])
        self.sync()

    def mark(
        self,
        prompt_ids: list[str] | tuple[str, ...],
        state: str,
        reason: str = "",
        step: int = -1,
        *,
        refilter: bool = False,
        token_versions: dict[str, dict[int, int]] | None = None,
    ) -> None:
        """Move prompts to ``state``. Moving a prompt out of a terminal state raises LedgerError, except
        ``refilter``: filtered prompts taken back into a batch (an exhausted batch's zero-advantage top-up).
        ``token_versions``: prompt id -> {policy version: sampled tokens of its group}, written with its event
        (``"token_versions"``, a trained group's accounting of which weights sampled it)."""
        with self._lock:
            for pid in prompt_ids:
                current = self._entries.get(pid)
                if current is not None and current[0] in TERMINAL and not (refilter and current[0] == FILTERED):
                    raise LedgerError(f"prompt {pid} is already {current[0]}; refusing {state}")
            events = [{"id": pid, "state": state, "reason": reason, "step": step} for pid in prompt_ids]
            for event in events if token_versions else ():
                if (counts := token_versions.get(event["id"])) is not None:
                    event["token_versions"] = {str(v): n for v, n in sorted(counts.items())}
            self._append(events)
            for pid in prompt_ids:
                self._entries[pid] = (state, reason, step)

    def record_episodes(self, ends: dict[str, list[str]], step: int = -1) -> None:
        """How each episode of each prompt's group ended (``{"id", "episodes": ["done", "failed: <why>", ...]}``
        events: notes in the log, no state change; the prompt's own state says whether it trained)."""
        with self._lock:
            self._append([{"id": pid, "episodes": episodes, "step": step} for pid, episodes in ends.items()])

    def rewind(self, prompt_ids: list[str], reason: str) -> int:
        """Forget prompts drawn after a checkpoint the run rolled back to (logged, then dropped)."""
        with self._lock:
            known = [pid for pid in prompt_ids if pid in self._entries]
            self._append([{"id": pid, "state": REWOUND, "reason": reason} for pid in known])
            for pid in known:
                del self._entries[pid]
            return len(known)

    def _append(self, events: list[dict]) -> None:
        """One ``write(2)`` for the events of one call: a killed controller leaves all of them or none (the demo's
        ~260 events a step take ~140 writes). Not fsynced: ``sync()``. A write that raises (OSError: a full disk) is
        truncated back to the last whole event, then re-raised. Fault point ``ledger.write``."""
        if self._path is None or not events:
            return
        data = "".join(json.dumps(event) + "\n" for event in events).encode()
        if faults.armed("ledger.write", f"{events[0].get('state', '')}/{events[0].get('step', -1)}"):
            start = data.rfind(b"\n", 0, len(data) // 2) + 1  # the line holding the middle byte, cut in its middle
            _write_all(self._fd, data[: (start + data.index(b"\n", start)) // 2])
            faults.crash("ledger.write")
        try:
            _write_all(self._fd, data)
        except OSError:
            os.ftruncate(self._fd, self._end)  # the next event starts a line of its own, after whole events
            raise
        self._end += len(data)

    def sync(self) -> None:
        """Make every event written so far durable (fsync): before a state that relies on them is saved, and
        before the batch file a replay would recover them from is deleted."""
        if self._path is not None and self._fd is not None:  # a closed ledger was synced as it closed
            os.fsync(self._fd)

    def state(self, prompt_id: str) -> tuple[str, str, int] | None:
        with self._lock:
            return self._entries.get(prompt_id)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(state for state, _, _ in self._entries.values()))

    def reasons(self, state: str) -> dict[str, int]:
        with self._lock:
            return dict(Counter(reason for s, reason, _ in self._entries.values() if s == state))

    def reason_kinds(self, state: str) -> dict[str, int]:
        """``reasons(state)`` counted by ``reason_kind``: what operators read (a reason's details vary per prompt)."""
        kinds: Counter[str] = Counter()
        for reason, count in self.reasons(state).items():
            kinds[reason_kind(reason)] += count
        return dict(kinds)

    def ids_in(self, state: str) -> list[str]:
        with self._lock:
            return [pid for pid, (s, _, _) in self._entries.items() if s == state]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """fsync and close (again: nothing)."""
        if self._path is not None and self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None


def reason_kind(reason: str) -> str:
    """A reason up to its first ": " ("reward function 'f' raised ValueError: ..." -> its first part), "" -> "?"."""
    return reason.split(": ", 1)[0] or "?"


def _event(raw: bytes) -> dict | None:
    """The event a log line holds; None for an empty line or one that is not an event."""
    try:
        event = json.loads(raw)
    except ValueError:
        return None
    return event if isinstance(event, dict) and ("id" in event or "note" in event) else None


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
