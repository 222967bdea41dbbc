"""One agentic episode, token-in/token-out (asyncio; many run at once on the controller's episode loop).

    reset -> render the prompt -> [generate -> parse tool calls -> environment step -> render the delta]* -> close

The episode's sequence is ``prompt_ids + response_ids`` where ``response_ids`` is each turn's sampled ids exactly as
the engine returned them, then the delta that answers the turn (relayrl/episodes/render.py), and so on; it ends
with the last turn's sampled ids. Sampled ids have loss mask 1, their engine logprob and the version that sampled
them; delta ids have mask 0, logprob 0, version 0. The next turn's prompt is that same sequence, so the engine
continues what will be trained, token for token (and an engine with a prefix cache prefills only the delta).

How an episode ends (``Episode.end``), and its reward:
- ``done`` / ``truncated``: the environment ended it; the reward is the one it gave with that step.
- ``max_turns``, ``max_total_tokens`` (prompt + sampled + observation tokens; a turn may sample at most what is
  left, and a delta that would not fit ends the episode before it), ``deadline`` (an environment call ran past
  ``environment.step_timeout_s``): relayrl ended it; the reward is what ``Close`` answers with that reason.
- ``failed`` (``Episode.reason`` says why): the environment answered an error, ended the episode without a
  reward, or generation failed after its retries. A failed episode is never trained.
A turn whose tool calls all failed to parse is answered by the error observations alone (the environment is
not called); a turn with valid calls sends them, and the answer holds a result for every call in call order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from relayrl.env.types import EnvError
from relayrl.episodes.render import ChatRenderer, TemplateError
from relayrl.episodes.toolcalls import merge_observations, parse_turn
from relayrl.v1 import common_pb2

DONE, TRUNCATED, MAX_TURNS, MAX_TOTAL_TOKENS, DEADLINE, FAILED = (
    "done", "truncated", "max_turns", "max_total_tokens", "deadline", "failed",
)  # fmt: skip
ENV_ENDS = frozenset({DONE, TRUNCATED})  # the environment ended the episode (finish reason "stop")


class GenerationFailed(Exception):
    """A turn could not be generated (every attempt failed); the message says why."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_total_tokens: int
    max_tokens: int  # per turn (rollout.max_tokens)


# generate(token_ids, max_tokens, affinity) -> the turn's Completion; affinity: the worker of the episode's last turn
Generate = Callable[[list[int], int, str], Awaitable[common_pb2.Completion]]


@dataclass
class Episode:
    """An episode's tokens (module docstring), how it ended, and what it measured."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: bytearray = field(default_factory=bytearray)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation, as the environment saw it
    tools: list[dict] = field(default_factory=list)
    turns: int = 0  # policy turns sampled
    end: str = ""
    reason: str = ""  # failed: why
    reward: float | None = None
    env_seconds: float = 0.0  # in environment calls (reset, steps, close)
    parse_errors: int = 0  # tool calls that failed to parse (error observations)
    observation_tokens: int = 0  # mask-0 tokens: deltas
    workers: list[str] = field(default_factory=list)  # the worker of each turn
    env_metrics: dict[str, list[float]] = field(default_factory=dict)  # per-turn metrics of the environment

    @property
    def failed(self) -> bool:
        return self.end == FAILED

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_sampled(self, completion: common_pb2.Completion) -> None:
        count = len(completion.token_ids)
        self.response_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += b"\x01" * count
        self.versions += completion.token_versions or [completion.policy_version] * count
        self.workers.append(completion.worker_id)
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += bytes(len(ids))
        self.versions += [0] * len(ids)
        self.observation_tokens += len(ids)

    def fail(self, reason: str) -> Episode:
        self.end, self.reason = FAILED, reason
        return self

    def completion(self, prompt_id: str, index: int) -> common_pb2.Completion:
        """The episode as a ``Completion``: the response with its loss mask and per-token versions; ``policy_version``
        the oldest that sampled a token; ``worker_id`` the worker of every turn ("" when turns moved between workers:
        the trainer then recomputes old logprobs); finish reason "stop" when the environment ended it, "length"
        when relayrl cut it short."""
        sampled = [v for v, m in zip(self.versions, self.mask) if m]
        return common_pb2.Completion(
            prompt_id=prompt_id,
            sample_index=index,
            token_ids=self.response_ids,
            logprobs=self.logprobs,
            finish_reason=common_pb2.FINISH_REASON_STOP if self.end in ENV_ENDS else common_pb2.FINISH_REASON_LENGTH,
            policy_version=min(sampled, default=0),
            worker_id=self.workers[0] if len(set(self.workers)) == 1 else "",
            loss_mask=bytes(self.mask),
            token_versions=self.versions,
        )


class EpisodeLoop:
    """Runs episodes against one environment session each. ``tokenizer``: the policy's (chat template included);
    ``generate``: a turn on a rollout worker (relayrl/episodes/turns.py)."""

    def __init__(self, tokenizer, generate: Generate, limits: EpisodeLimits) -> None:
        self.tokenizer = tokenizer
        self.generate = generate
        self.limits = limits

    async def run(self, sessions, session_id: str, task: dict, seed: int | None) -> Episode:
        """One episode in a session of ``sessions`` (an ``EnvironmentPool``: ``open(session_id, task, seed)`` yields
        (client, Reset)). Never raises but on cancellation (the session is then closed with reason "aborted").
        ``env_seconds`` counts from the wait for a session slot to the close."""
        episode = Episode()
        clock = _EnvClock(episode)
        start = time.perf_counter()
        try:
            async with sessions.open(session_id, task, seed) as (env, reset):
                episode.env_seconds += time.perf_counter() - start
                return await self._episode(env, session_id, episode, reset, clock)
        except EnvError as err:
            episode.env_seconds += time.perf_counter() - start
            return episode.fail(f"environment reset failed: {err}")

    async def _episode(self, env, session_id: str, episode: Episode, reset, clock: _EnvClock) -> Episode:
        try:
            end = await self._turns(env, session_id, episode, reset, clock)
        except asyncio.CancelledError:
            await asyncio.shield(clock.close_quietly(env, session_id, "aborted"))
            raise
        except EnvError as err:
            if not err.deadline:
                await clock.close_quietly(env, session_id, "aborted")
                return episode.fail(f"environment error after {episode.turns} turns: {err}")
            end = DEADLINE
        except (GenerationFailed, TemplateError) as err:
            await clock.close_quietly(env, session_id, "aborted")
            return episode.fail(f"turn {episode.turns + 1}: {err}")
        if end in ENV_ENDS:
            await clock.close_quietly(env, session_id, "")
            if episode.reward is None:
                return episode.fail(f"the environment ended the episode ({end}) without a reward")
            episode.end = end
            return episode
        try:
            episode.reward = await clock.time(env.close(session_id, end))
        except EnvError as err:
            return episode.fail(f"environment close ({end}) failed: {err}")
        if episode.reward is None:
            return episode.fail(f"ended by {end}; the environment's close gave no reward")
        episode.end = end
        return episode

    async def _turns(self, env, session_id: str, episode: Episode, reset, clock: _EnvClock) -> str:
        """Generate and step until an end; returns the end (the reward of an environment end set on ``episode``)."""
        limits = self.limits
        renderer = ChatRenderer(self.tokenizer, reset.tools)
        conversation = list(reset.messages)
        episode.messages, episode.tools = conversation, list(reset.tools)
        episode.prompt_ids = renderer.prompt(conversation)
        while True:
            budget = limits.max_total_tokens - episode.length
            if budget < 1:
                return MAX_TOTAL_TOKENS
            max_tokens = min(limits.max_tokens, budget)
            completion = await self.generate(
                episode.prompt_ids + episode.response_ids, max_tokens, episode.workers[-1] if episode.workers else ""
            )
            episode.add_sampled(completion)
            if max_tokens == budget and completion.finish_reason == common_pb2.FINISH_REASON_LENGTH:
                return MAX_TOTAL_TOKENS  # cut by the episode's budget: the turn is not sent
            parsed = parse_turn(
                self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), reset.tools, episode.turns
            )
            episode.parse_errors += len(parsed.errors)
            observations: list[dict] = []
            if parsed.calls or not parsed.errors:
                step = await clock.time(env.step(session_id, parsed.message))
                for name, value in step.metrics.items():
                    episode.env_metrics.setdefault(name, []).append(value)
                observations = step.observations
                if step.done or step.truncated:
                    conversation += [parsed.message, *merge_observations(parsed, observations)]
                    episode.reward = step.reward
                    return DONE if step.done else TRUNCATED
            answer = merge_observations(parsed, observations)
            sampled_text = self.tokenizer.decode(completion.token_ids)
            delta = renderer.delta([*conversation, parsed.message], answer, sampled_text)
            conversation += [parsed.message, *answer]
            if episode.turns >= limits.max_turns:
                return MAX_TURNS  # the answer is in the conversation; no turn follows it, so not in the tokens
            if episode.length + len(delta) >= limits.max_total_tokens:
                return MAX_TOTAL_TOKENS  # no room for the answer and a token after it
            episode.add_observation(delta)


class _EnvClock:
    """Times an episode's environment calls into ``episode.env_seconds``."""

    def __init__(self, episode: Episode) -> None:
        self.episode = episode

    async def time(self, call: Awaitable):
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.episode.env_seconds += time.perf_counter() - start

    async def close_quietly(self, env, session_id: str, reason: str) -> None:
        """Release the session; a close that fails changes nothing (the server reclaims idle sessions itself)."""
        with contextlib.suppress(EnvError):
            await self.time(env.close(session_id, reason))
