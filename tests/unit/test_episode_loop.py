"""How episodes end: done, truncated, max_turns, max_total_tokens, deadline, and failed with a reason; the
environment pool's session bound and its Reset retries."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest

from relayrl.env import EnvError, Environment, Reset, Step
from relayrl.env.examples.guess import GuessNumber
from relayrl.episodes.envpool import EnvironmentPool
from relayrl.episodes.loop import (
    DEADLINE,
    FAILED,
    MAX_TOTAL_TOKENS,
    MAX_TURNS,
    TRUNCATED,
    EpisodeLimits,
    EpisodeLoop,
    GenerationFailed,
)
from relayrl.models.tiny_chat import build_chat_tokenizer, write_tiny_chat_model
from relayrl.rollout.hf import HFEngine
from relayrl.v1 import common_pb2
from relayrl.wire.sampling import SamplingParams
from tests.unit.episode_testing import ScriptedPolicy, local_pool

PLAIN = {"secret": 5, "tools": False}


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


class Slow(GuessNumber):
    async def step(self, action: dict) -> Step:  # cancelled at its deadline: the session can close at once
        await asyncio.sleep(0.5)
        return GuessNumber.step(self, action)


class SlowSync(GuessNumber):
    def step(self, action: dict) -> Step:  # runs on past its deadline: the close finds the call still running
        time.sleep(0.5)
        return super().step(action)


class Broken(GuessNumber):
    def step(self, action: dict) -> Step:
        raise RuntimeError("the simulator crashed")


class Rewardless(GuessNumber):
    def step(self, action: dict) -> Step:
        return Step([{"role": "user", "content": "bye"}], done=True)


LIMITS = EpisodeLimits(3, 4096, 32)


def run(tokenizer, texts, env=GuessNumber, *, limits=LIMITS, timeout_s=5.0, generate=None):
    policy = generate or ScriptedPolicy(tokenizer, texts)

    async def main():
        pool = local_pool(env, timeout_s=timeout_s)
        try:
            return await EpisodeLoop(tokenizer, policy, limits).run(pool, "s", PLAIN, 1)
        finally:
            await pool.close()

    return asyncio.run(main())


def test_max_turns_ends_with_the_reward_close_gives(tokenizer):
    episode = run(tokenizer, ["1"])
    assert (episode.end, episode.turns, episode.reward) == (MAX_TURNS, 3, 0.0)
    assert episode.completion("p", 0).finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_the_environment_may_truncate(tokenizer):
    episode = run(tokenizer, ["1"], limits=EpisodeLimits(10, 4096, 32))
    assert (episode.end, episode.turns, episode.reward) == (TRUNCATED, GuessNumber.max_turns, 0.0)


def test_max_total_tokens_counts_observations_and_is_never_exceeded(tokenizer):
    probe = run(tokenizer, ["1"], limits=EpisodeLimits(1, 4096, 32))
    budget = probe.length + 5  # room for the first turn, not for its answer (9 tokens) and a second turn
    episode = run(tokenizer, ["1"], limits=EpisodeLimits(5, budget, 32))
    assert episode.end == MAX_TOTAL_TOKENS and episode.turns == 1
    assert episode.length <= budget and episode.observation_tokens == 0


def test_a_turn_cut_by_the_budget_ends_the_episode_unsent(tokenizer):
    probe = run(tokenizer, ["1"], limits=EpisodeLimits(1, 4096, 32))
    episode = run(tokenizer, ["one two three four five six"], limits=EpisodeLimits(5, len(probe.prompt_ids) + 3, 32))
    assert (episode.end, episode.turns, episode.length) == (MAX_TOTAL_TOKENS, 1, len(probe.prompt_ids) + 3)


def test_a_step_past_its_deadline_ends_the_episode_by_deadline(tokenizer):
    episode = run(tokenizer, ["1"], env=Slow, timeout_s=0.1)
    assert (episode.end, episode.reward) == (DEADLINE, 0.0)
    assert episode.env_seconds >= 0.1
    stuck = run(tokenizer, ["1"], env=SlowSync, timeout_s=0.1)
    assert stuck.end == FAILED and stuck.reason == "ended by deadline; the environment's close gave no reward"


def test_an_environment_error_fails_the_episode_with_its_message(tokenizer):
    episode = run(tokenizer, ["1"], env=Broken)
    assert episode.end == FAILED and "the simulator crashed" in episode.reason and "INTERNAL" in episode.reason


def test_an_end_without_a_reward_fails(tokenizer):
    episode = run(tokenizer, ["1"], env=Rewardless)
    assert episode.end == FAILED and "without a reward" in episode.reason


def test_a_generation_failure_fails_the_episode(tokenizer):
    async def generate(token_ids, max_tokens, affinity=""):
        raise GenerationFailed("3 attempts failed, last: UNAVAILABLE: worker gone")

    episode = run(tokenizer, [], generate=generate)
    assert episode.end == FAILED and episode.reason == "turn 1: 3 attempts failed, last: UNAVAILABLE: worker gone"


def test_a_turn_of_bad_calls_alone_is_answered_without_stepping(tokenizer):
    class Counting(GuessNumber):
        def step(self, action):
            assert action.get("tool_calls") or action["content"], action
            return super().step(action)

    episode = run(tokenizer, ["<tool_call>{nope</tool_call>", "5"], env=Counting)
    assert episode.end == "done" and episode.turns == 2 and episode.parse_errors == 1


class Fake:
    """A client whose Reset answers ``codes`` in turn (then succeeds)."""

    def __init__(self, codes):
        self.codes, self.resets, self.closed = list(codes), 0, []

    async def reset(self, session_id, task, seed=None):
        self.resets += 1
        if self.codes:
            raise EnvError(self.codes.pop(0), "refused")
        await asyncio.sleep(0.01)
        return Reset([{"role": "user", "content": "hi"}])

    async def close(self, session_id, reason=""):
        self.closed.append(reason)

    async def disconnect(self):
        pass


def test_the_pool_bounds_sessions_per_server_and_retries_refused_resets():
    async def main():
        clients = {"a": Fake([grpc.StatusCode.UNAVAILABLE]), "b": Fake([])}
        pool = EnvironmentPool(["a", "b"], max_sessions=2, timeout_s=1, client_factory=clients.get, down_s=0.05)
        peak = 0

        async def episode(i):
            nonlocal peak
            async with pool.open(f"s{i}", {}, None) as (client, _reset):
                peak = max(peak, max(s.sessions for s in pool.servers.values()))
                await asyncio.sleep(0.02)
                return client

        used = await asyncio.gather(*(episode(i) for i in range(10)))
        assert peak <= 2 and len(used) == 10
        assert clients["a"].resets >= 2  # refused once, then used again once it was back
        bad = EnvironmentPool(
            ["c"], max_sessions=1, timeout_s=1, client_factory=lambda _: Fake([grpc.StatusCode.INVALID_ARGUMENT])
        )
        with pytest.raises(EnvError):
            async with bad.open("x", {}, None):
                pass
        assert bad.servers["c"].sessions == 0 and bad.servers["c"].client.closed == ["aborted"]

    asyncio.run(main())


def test_an_environment_sdk_class_runs_through_the_pool(tokenizer):
    """The pool drives ``Environment`` subclasses through the real session table (``AsyncLocalEnvironmentClient``)."""

    class Echo(Environment):
        def reset(self, task, seed):
            return Reset([{"role": "user", "content": f"seed {seed}"}])

        def step(self, action):
            return Step([], reward=0.5, done=True)

    episode = run(tokenizer, ["hello"], env=Echo)
    assert (episode.end, episode.reward, episode.turns) == ("done", 0.5, 1)
    assert episode.messages[0]["content"] == "seed 1"


def test_later_turns_on_the_hf_engine_prefill_only_their_new_tokens(tokenizer, tmp_path):
    """An episode's turns on the hf engine (its prefix KV cache, relayrl/rollout/prefix_cache.py): from turn 2 on,
    the engine prefills only the last turn's final sampled token and the observation delta."""
    engine = HFEngine(str(write_tiny_chat_model(tmp_path, pretrain=False)))
    turns: list[tuple[list[int], list[int], int, int]] = []  # prompt, sampled, prefilled, reused

    async def generate(token_ids, max_tokens, affinity=""):
        before = engine.prefill_counts()
        params = SamplingParams(max_tokens=max_tokens, seed=len(turns))
        (out,) = await asyncio.to_thread(lambda: list(engine.generate([token_ids], params)))
        after = engine.prefill_counts()
        turns.append((list(token_ids), out.token_ids, after.computed - before.computed, after.reused - before.reused))
        finish = common_pb2.FINISH_REASON_STOP if out.finish_reason == "stop" else common_pb2.FINISH_REASON_LENGTH
        return common_pb2.Completion(token_ids=out.token_ids, logprobs=out.logprobs, finish_reason=finish)

    episode = run(tokenizer, [], limits=EpisodeLimits(3, 4096, 8), generate=generate)
    engine.close()
    assert episode.turns == len(turns) >= 2
    assert turns[0][2:] == (len(turns[0][0]), 0)
    for (prompt, sampled, _, _), (later, _, prefilled, reused) in itertools.pairwise(turns):
        kept = len(prompt) + len(sampled) - 1  # the last sampled token was never fed: no KV
        assert (prefilled, reused) == (len(later) - kept, kept)
