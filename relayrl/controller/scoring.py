"""Rewards for completed groups: task score from the reward function, plus DAPO overlong shaping."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from relayrl.config import RewardConfig
from relayrl.data.dataset import PromptRecord
from relayrl.data.fast_tokens import decode_sequences
from relayrl.rewards import resolve_reward
from relayrl.trainer.algorithms.overlong import overlong_penalty
from relayrl.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass
class ScoredGroup:
    record: PromptRecord
    completions: list[common_pb2.Completion]
    scores: list[float]  # task reward
    rewards: list[float]  # score + overlong penalty: what advantages are computed from
    response_tokens: int = field(init=False)  # sum of the responses' lengths (the batch's statistics)

    def __post_init__(self) -> None:
        self.response_tokens = sum(len(c.token_ids) for c in self.completions)

    @property
    def min_version(self) -> int:
        return min(c.policy_version for c in self.completions)


class Scorer:
    def __init__(self, cfg: RewardConfig, tokenizer, max_tokens: int) -> None:
        self.cfg = cfg
        self.fn = resolve_reward(cfg.fn)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def decode_all(self, completions: list[common_pb2.Completion]) -> list[str]:
        """``tokenizer.decode(ids, skip_special_tokens=True)`` of each completion (``decode_sequences``)."""
        return decode_sequences(self.tokenizer, [c.token_ids for c in completions])

    def score(self, text: str, answer: str, fn=None) -> float:
        """``fn`` (default: the config's reward function) of the response; one that raises scores 0 and is logged."""
        fn = fn or self.fn
        try:
            return float(fn(text, answer))
        except Exception:  # a user's reward function must not take the controller down
            log.exception("reward function %s failed on %r", getattr(fn, "__name__", fn), text[:200])
            return 0.0

    def shaped(self, score: float, response_len: int) -> float:
        """score + DAPO soft overlong penalty over the last ``overlong_buffer`` tokens."""
        if self.cfg.overlong_buffer <= 0:
            return score
        return score + overlong_penalty(
            response_len, self.max_tokens, self.cfg.overlong_buffer, self.cfg.overlong_penalty
        )

    def group(self, record: PromptRecord, completions: list[common_pb2.Completion]) -> ScoredGroup:
        completions = sorted(completions, key=lambda c: c.sample_index)
        scores = [self.score(text, record.answer) for text in self.decode_all(completions)]
        rewards = [self.shaped(s, len(c.token_ids)) for s, c in zip(scores, completions)]
        return ScoredGroup(record, completions, scores, rewards)
