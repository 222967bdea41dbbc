"""Rewards for completed groups: task score from the reward function (or an episode's environment), plus DAPO
overlong shaping.

The task score of an episode with ``controller.reward.with_env``: "env" -> the environment's reward; "env_plus_fn"
-> that + fn's value; "fn" -> fn's value alone. A single-turn sample has no environment: fn's value. A reward
function that raises fails its group (``RewardRaised``); one that returns a wrong shape stops the run
(``RewardShapeError``): neither is trained on a made-up score."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.algorithms.overlong import overlong_penalty
from relayrl.config import RewardConfig, ScorerConfig
from relayrl.data.dataset import PromptRecord
from relayrl.data.fast_tokens import decode_sequences
from relayrl.rewards import GroupInputs, RewardCaller, RewardRaised, check_reward
from relayrl.rewards.served import ScorerClient, ScorerFailed
from relayrl.rewards.weighted import weighted_rewards
from relayrl.v1 import common_pb2
from relayrl.wire.sampling import stop_text

# SubmitPrompts.reward_fn naming the config's own reward (controller.reward: fns weighted, else fn)
CONFIG_REWARD = "config"


@dataclass
class ScoredGroup:
    record: PromptRecord
    completions: list[common_pb2.Completion]
    scores: list[float]  # task reward
    rewards: list[float]  # score + overlong penalty: what advantages are computed from
    parts: dict[str, list[float]] = field(default_factory=dict)  # each reward function's values (unweighted), by name
    teacher_logprobs: list[list[float]] = field(default_factory=list)  # distill: each response token's, by sample
    episodes: list = field(default_factory=list)  # agentic runs: the group's Episodes (relayrl/episodes/loop.py)
    response_tokens: int = field(init=False)  # sum of the responses' lengths (the batch's statistics)

    def __post_init__(self) -> None:
        self.response_tokens = sum(len(c.token_ids) for c in self.completions)

    @property
    def min_version(self) -> int:
        return min(c.policy_version for c in self.completions)


@dataclass(frozen=True)
class EpisodeOutcome:
    """What an environment episode adds to its sample's scoring: the conversation (chat-message dicts, opening
    to last turn) and the environment's episode reward."""

    conversation: list[dict]
    env_reward: float


def last_assistant(conversation: Sequence[Mapping[str, Any]]) -> str:
    """The content of the conversation's last assistant message ('' when it has none): an episode's response."""
    return next((str(m.get("content", "")) for m in reversed(conversation) if m.get("role") == "assistant"), "")


def group_inputs(
    prompt: str, answer: str, row: Mapping[str, Any], texts: list[str], episodes: Sequence[EpisodeOutcome] | None
) -> GroupInputs:
    """A group's reward-function inputs. Single-turn: each conversation is [user prompt, assistant response] and
    there are no environment rewards; episodes: their conversations and rewards, each response the episode's last
    assistant message."""
    if episodes is None:
        conversations = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": t}] for t in texts]
        return GroupInputs(texts, answer, prompt, row, conversations, [None] * len(texts))
    conversations = [e.conversation for e in episodes]
    responses = [last_assistant(c) for c in conversations]
    return GroupInputs(responses, answer, prompt, row, conversations, [e.env_reward for e in episodes])


class Scorer:
    """``row_of(prompt_id)``: the dataset row of a drawn prompt, read only when the reward function asks for it."""

    def __init__(
        self,
        cfg: RewardConfig,
        tokenizer,
        max_tokens: int,
        row_of: Callable[[str], Mapping[str, Any]],
        *,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        scorers: Mapping[str, ScorerConfig] | None = None,
        teacher: str | None = None,
    ) -> None:
        """``scorers``: the run's (``scorers``), for the served rewards of ``cfg.fns``; ``teacher``: the scorer whose
        log-probs of each response's tokens a group gets (``algorithm.advantage: distill``)."""
        self.cfg = cfg
        self.stop, self.include_stop = tuple(stop), include_stop
        self.reward: RewardCaller = check_reward(cfg)  # fn's caller (a client's SubmitPrompts may name it)
        self.rewards = weighted_rewards(cfg, scorers or {})  # what scores a group: fns weighted, else fn
        self.teacher = ScorerClient(teacher, (scorers or {})[teacher]) if teacher else None
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.row_of = row_of

    @property
    def clients(self) -> dict[str, ScorerClient]:
        """Every scorer this scorer calls, by name: the served rewards' and the teacher's."""
        return {**self.rewards.served, **({self.teacher.name: self.teacher} if self.teacher is not None else {})}

    def named(self, name: str) -> Callable[[GroupInputs], list[float]] | None:
        """The config's reward as a client names it (``SubmitPrompts.reward_fn``): ``CONFIG_REWARD`` is the task
        score training uses (``fns`` weighted, else ``fn``), a spec of ``fn`` or a key of ``fns`` that function
        alone; None: not the config's."""
        if name == CONFIG_REWARD:
            return lambda inputs: self.rewards(inputs)[0]
        own = dict(zip(self.cfg.fns or [self.cfg.fn], (caller for _, _, caller in self.rewards.callers)))
        own.setdefault(self.cfg.fn, self.reward)
        return own.get(name)

    def decode_all(self, completions: list[common_pb2.Completion]) -> list[str]:
        """``tokenizer.decode(ids, skip_special_tokens=True)`` of each completion (``decode_sequences``), cut at its
        stop string as vLLM cuts its text (``stop_text``: rollout.stop, rollout.include_stop_str_in_output)."""
        texts = decode_sequences(self.tokenizer, [c.token_ids for c in completions])
        return [stop_text(t, self.stop, self.include_stop) for t in texts] if self.stop else texts

    def task_scores(self, inputs: GroupInputs, *, episodes: bool) -> tuple[list[float], dict[str, list[float]]]:
        """The group's task scores (module docstring; the reward functions' weighted sum where they score) and each
        function's values by name; RewardRaised / RewardShapeError from a function."""
        if episodes and self.cfg.with_env == "env":
            return [float(r) for r in inputs.env_rewards], {}
        scores, parts = self.rewards(inputs)
        if episodes and self.cfg.with_env == "env_plus_fn":
            return [float(e) + s for e, s in zip(inputs.env_rewards, scores)], parts
        return scores, parts

    def shaped(self, score: float, response_len: int) -> float:
        """score + DAPO soft overlong penalty over the last ``overlong_buffer`` tokens."""
        if self.cfg.overlong_buffer <= 0:
            return score
        return score + overlong_penalty(
            response_len, self.max_tokens, self.cfg.overlong_buffer, self.cfg.overlong_penalty
        )

    def episode_group(self, record: PromptRecord, episodes: list) -> ScoredGroup:
        """A group of agentic episodes (relayrl/episodes/loop.py ``Episode``), scored by ``group`` with their
        conversations and environment rewards. Every episode must have opened with the same prompt (one task, one
        seed): the samples share it as the group's prompt. Overlong shaping measures an episode's response (sampled
        and observation tokens) against ``max_tokens`` (an agentic scorer is given ``environment.max_total_tokens``)."""
        if len({tuple(e.prompt_ids) for e in episodes}) != 1:
            raise RewardRaised(f"{record.prompt_id}: the environment opened one task and seed with different prompts")
        record = dataclasses.replace(record, token_ids=list(episodes[0].prompt_ids))
        completions = [e.completion(record.prompt_id, i) for i, e in enumerate(episodes)]
        outcomes = [EpisodeOutcome(e.messages, float(e.reward)) for e in episodes]
        scored = self.group(record, completions, outcomes)
        scored.episodes = list(episodes)
        return scored

    def group(
        self,
        record: PromptRecord,
        completions: list[common_pb2.Completion],
        episodes: Sequence[EpisodeOutcome] | None = None,
    ) -> ScoredGroup:
        """Score one prompt's group; ``episodes`` (aligned with ``completions`` by sample index): their outcomes."""
        order = sorted(range(len(completions)), key=lambda i: completions[i].sample_index)
        completions = [completions[i] for i in order]
        if episodes is not None:
            episodes = [episodes[i] for i in order]
        row = self.row_of(record.prompt_id) if self.rewards.wants("row") else {}
        texts = self.decode_all(completions) if episodes is None else []
        inputs = group_inputs(record.text, record.answer, row, texts, episodes)
        scores, parts = self.task_scores(inputs, episodes=episodes is not None)
        rewards = [self.shaped(s, len(c.token_ids)) for s, c in zip(scores, completions)]
        teacher = self.teacher_logprobs(record, completions) if self.teacher is not None and episodes is None else []
        return ScoredGroup(record, completions, scores, rewards, parts, teacher)

    def teacher_logprobs(self, record: PromptRecord, completions: list[common_pb2.Completion]) -> list[list[float]]:
        """The teacher's log-prob of each response token of the group (one TokenLogprobs call, as the group
        completes); RewardRaised with the scorer's message when it cannot answer (the group fails)."""
        try:
            return self.teacher.token_logprobs([(record.token_ids, list(c.token_ids)) for c in completions])
        except ScorerFailed as err:
            raise RewardRaised(str(err)) from err
