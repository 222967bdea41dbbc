"""A scorer worker: one model (``relayrl.scorer.models``) behind one dynamic batcher; what the gRPC layer calls.

``score`` / ``token_logprobs`` check every item of a request first (so a bad item refuses the whole request before
anything queues, naming it), then wait for their results from the batcher."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.config import ScorerConfig
from relayrl.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from relayrl.scorer.batcher import DynamicBatcher
from relayrl.scorer.models import Pair, ScoringModel

ROLES = ("system", "user", "assistant", "tool")


class ScorerWorker:
    def __init__(self, name: str, cfg: ScorerConfig, model: ScoringModel) -> None:
        self.name, self.cfg, self.model = name, cfg, model
        self.batcher = DynamicBatcher(model.run, max_batch_size=cfg.max_batch_size, max_wait_s=cfg.max_wait_ms / 1000)

    def _checked(self, pairs: Sequence[Pair], *, messages: bool) -> list:
        if not pairs:
            raise InvalidArgument("items", "must not be empty")
        if len(pairs) > self.cfg.max_items:
            raise ResourceExhausted("items", self.cfg.max_items, len(pairs))
        if messages:
            for i, pair in enumerate(pairs):
                check_messages(f"items[{i}].messages", pair.messages, self.cfg.max_text_chars)
        return [self.model.check(i, pair) for i, pair in enumerate(pairs)]

    def score(self, pairs: Sequence[Pair]) -> list[float]:
        """One scalar per pair (a classifier's or a judge's)."""
        if self.model.kind == "teacher":
            raise FailedPrecondition(f"scorer {self.name} is a teacher: it answers TokenLogprobs, not Score")
        return self.batcher.submit(self._checked(pairs, messages=True))

    def token_logprobs(self, pairs: Sequence[Pair]) -> list[list[float]]:
        """The teacher's log-prob of each response token of each pair."""
        if self.model.kind != "teacher":
            raise FailedPrecondition(f"scorer {self.name} is a {self.model.kind}: it answers Score, not TokenLogprobs")
        return self.batcher.submit(self._checked(pairs, messages=False))

    def stop(self) -> None:
        self.batcher.stop()
        self.model.close()


def check_messages(field: str, messages: Sequence[dict[str, str]], max_chars: int) -> None:
    """A conversation that ends with the response: known roles, contents within ``max_chars``, the last message the
    assistant's. InvalidArgument / ResourceExhausted naming ``field[j]``."""
    if not messages:
        raise InvalidArgument(field, "must not be empty: the prompt's turns, then the response")
    for j, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise InvalidArgument(f"{field}[{j}].role", f"{message['role'][:32]!r} is not one of {', '.join(ROLES)}")
        if len(message["content"]) > max_chars:
            raise ResourceExhausted(f"{field}[{j}].content length", max_chars, len(message["content"]))
    if messages[-1]["role"] != "assistant":
        raise InvalidArgument(f"{field}[{len(messages) - 1}].role", "the last message is the response: 'assistant'")
