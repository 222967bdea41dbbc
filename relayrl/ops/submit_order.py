"""``relayrl submit``'s output order: the completions of each prompt together, prompts in input order."""

from __future__ import annotations

from relayrl.client import Completion


class InputOrder:
    """Re-emits completions in input order: prompt i's ``n`` samples (by sample index) as soon as all arrived and
    every earlier prompt's were emitted, so a long run still writes as it goes."""

    def __init__(self, prompt_ids: list[str], n: int) -> None:
        self.order, self.n, self.next = prompt_ids, n, 0
        self.held: dict[str, list[Completion]] = {pid: [] for pid in prompt_ids}

    def add(self, completion: Completion) -> list[Completion]:
        """The completions this one releases, in order (none while an earlier prompt is incomplete)."""
        self.held[completion.prompt_id].append(completion)
        released: list[Completion] = []
        while self.next < len(self.order) and len(self.held[self.order[self.next]]) >= self.n:
            released += self._release(self.order[self.next])
            self.next += 1
        return released

    def rest(self) -> list[Completion]:
        """What is still held (the call ended early), in input order."""
        released = [c for pid in self.order[self.next :] for c in self._release(pid)]
        self.next = len(self.order)
        return released

    def _release(self, prompt_id: str) -> list[Completion]:
        return sorted(self.held.pop(prompt_id), key=lambda c: c.sample_index)
