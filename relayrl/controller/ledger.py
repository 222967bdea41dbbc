"""The prompt ledger: every drawn prompt id ends as trained, filtered (and why) or failed (and why).

State lives in an append-only JSONL event log, replayed on start, so a restarted controller knows
every prompt's fate. Terminal states never change; a second terminal event for an id is refused.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

PENDING, QUEUED, TRAINED, FILTERED, FAILED = "pending", "queued", "trained", "filtered", "failed"
REWOUND = "rewound"  # an event, not a state: the run was rolled back to before this prompt was drawn
TERMINAL = frozenset({TRAINED, FILTERED, FAILED})


class LedgerError(RuntimeError):
    pass


class Ledger:
    """prompt id -> (state, reason, step). Thread-safe; persisted when ``path`` is given."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, str, int]] = {}
        self._path = Path(path) if path else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            if self._path.exists():
                self._replay()
            self._file = self._path.open("a", buffering=1)

    def _replay(self) -> None:
        assert self._path is not None
        for line in self._path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                if "state" not in event:  # a note (record_episodes), not a state change
                    continue
                if event["state"] == REWOUND:
                    self._entries.pop(event["id"], None)
                else:
                    self._entries[event["id"]] = (event["state"], event.get("reason", ""), event.get("step", -1))

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
            for pid in prompt_ids:
                self._entries[pid] = (state, reason, step)
            events = [{"id": pid, "state": state, "reason": reason, "step": step} for pid in prompt_ids]
            for event in events if token_versions else ():
                if (counts := token_versions.get(event["id"])) is not None:
                    event["token_versions"] = {str(v): n for v, n in sorted(counts.items())}
            self._append(events)

    def record_episodes(self, ends: dict[str, list[str]], step: int = -1) -> None:
        """How each episode of each prompt's group ended (``{"id", "episodes": ["done", "failed: <why>", ...]}``
        events: notes in the log, no state change; the prompt's own state says whether it trained)."""
        with self._lock:
            self._append([{"id": pid, "episodes": episodes, "step": step} for pid, episodes in ends.items()])

    def rewind(self, prompt_ids: list[str], reason: str) -> int:
        """Forget prompts drawn after a checkpoint the run rolled back to (logged, then dropped)."""
        with self._lock:
            known = [pid for pid in prompt_ids if pid in self._entries]
            for pid in known:
                del self._entries[pid]
            self._append([{"id": pid, "state": REWOUND, "reason": reason} for pid in known])
            return len(known)

    def _append(self, events: list[dict]) -> None:
        """One write for the events of one call (in the kernel when the call returns: a killed controller loses
        none). The demo's ~260 events a step took a write each, now ~140 writes."""
        if self._path is not None and events:
            self._file.write("".join(json.dumps(event) + "\n" for event in events))

    def state(self, prompt_id: str) -> tuple[str, str, int] | None:
        with self._lock:
            return self._entries.get(prompt_id)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(state for state, _, _ in self._entries.values()))

    def reasons(self, state: str) -> dict[str, int]:
        with self._lock:
            return dict(Counter(reason for s, reason, _ in self._entries.values() if s == state))

    def ids_in(self, state: str) -> list[str]:
        with self._lock:
            return [pid for pid, (s, _, _) in self._entries.items() if s == state]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        if self._path is not None:
            self._file.close()
