"""The session table behind ``relayrl env serve`` and ``LocalEnvironmentClient``: limits, statuses, envs."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import grpc
import pytest

from relayrl.env import EnvError, Environment, LocalEnvironmentClient, Reset, Step
from relayrl.env.sessions import SessionTable
from relayrl.errors import InvalidArgument, RelayError
from relayrl.v1 import environment_pb2 as pb

SAY = {"role": "assistant", "content": "4"}


class Counter(Environment):
    """Counts turns; done at ``task["turns"]`` with reward = turns; remembers how it was closed."""

    closed: ClassVar[list[str]] = []

    def reset(self, task: dict, seed: int | None) -> Reset:
        if "turns" in task and not isinstance(task["turns"], int):
            raise InvalidArgument("task.turns", "must be an integer")
        self.turns, self.limit, self.seed = 0, task.get("turns", 2), seed
        return Reset([{"role": "user", "content": f"count to {self.limit} (seed {seed})"}])

    def step(self, action: dict) -> Step:
        if action["content"] == "boom":
            raise ValueError("the environment broke")
        self.turns += 1
        done = self.turns >= self.limit
        return Step(
            [{"role": "user", "content": str(self.turns)}], reward=float(self.turns) if done else None, done=done
        )

    def close(self, reason: str) -> float | None:
        Counter.closed.append(reason)
        return 0.5 if reason else None


class AsyncCounter(Counter):
    async def reset(self, task: dict, seed: int | None) -> Reset:
        await asyncio.sleep(0)
        return Counter.reset(self, task, seed)

    async def step(self, action: dict) -> Step:
        if action["content"] == "hang":
            await asyncio.sleep(3600)
        return Counter.step(self, action)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(EnvError) as err:
        call()
    return err.value.code


@pytest.mark.parametrize("env_class", [Counter, AsyncCounter])
def test_an_episode_sync_and_async(env_class) -> None:
    with LocalEnvironmentClient(env_class, timeout_s=10) as env:
        opening = env.reset("s1", {"turns": 2}, seed=7)
        assert opening.messages == [{"role": "user", "content": "count to 2 (seed 7)"}]
        assert opening.tools == []
        first = env.step("s1", SAY)
        assert (first.reward, first.done, first.observations) == (None, False, [{"role": "user", "content": "1"}])
        last = env.step("s1", SAY)
        assert (last.reward, last.done) == (2.0, True)
        assert env.close("s1") is None
        assert env.reset("s2", {}, seed=None).messages[0]["content"] == "count to 2 (seed None)"
        assert env.close("s2", reason="max_turns") == 0.5
        assert env.info() == {"name": env_class.__name__, "max_sessions": 0, "sessions": 0}


def test_max_sessions_already_exists_and_not_found() -> None:
    with LocalEnvironmentClient(Counter, max_sessions=2) as env:
        env.reset("a", {}, 0)
        assert code_of(lambda: env.reset("a", {}, 0)) == grpc.StatusCode.ALREADY_EXISTS
        env.reset("b", {}, 0)
        assert code_of(lambda: env.reset("c", {}, 0)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert env.info()["sessions"] == 2
        env.close("a")
        env.reset("c", {}, 0)  # a closed session frees its slot
        assert code_of(lambda: env.step("a", SAY)) == grpc.StatusCode.NOT_FOUND
        assert env.close("never-reset") is None  # idempotent


def test_an_environment_exception_is_a_status_and_the_table_keeps_serving() -> None:
    with LocalEnvironmentClient(Counter) as env:
        env.reset("s", {}, 0)
        with pytest.raises(EnvError) as err:
            env.step("s", {"role": "assistant", "content": "boom"})
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert "ValueError: the environment broke" in err.value.reason
        assert env.step("s", SAY).observations[0]["content"] == "1"  # the same session goes on
        with pytest.raises(EnvError) as err:
            env.reset("t", {"turns": "two"}, 0)  # an environment's own InvalidArgument keeps its status
        assert (err.value.code, err.value.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "task.turns: must be an integer",
        )
        assert env.info()["sessions"] == 1  # the failed reset holds no slot


def test_idle_sessions_are_reclaimed() -> None:
    now = [0.0]
    Counter.closed = []
    table = SessionTable(Counter, idle_timeout_s=60, clock=lambda: now[0])
    table.reset(pb.ResetRequest(session_id="old", task="{}"))
    now[0] = 50.0
    table.reset(pb.ResetRequest(session_id="new", task="{}"))
    now[0] = 100.0
    table.step(pb.StepRequest(session_id="new", action=pb.ChatMessage(role="assistant", content="1")))
    assert table.reap() == ["old"]  # idle 100 s; "new" stepped at 100
    with pytest.raises(RelayError) as err:
        table.step(pb.StepRequest(session_id="old", action=pb.ChatMessage(role="assistant")))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert Counter.closed == ["expired"]
    assert table.info().sessions == 1
    table.shutdown()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.ResetRequest(task="{}"), "session_id: must not be empty"),
        (pb.ResetRequest(session_id="x" * 300), "session_id length: 300 exceeds the limit 256"),
        (pb.ResetRequest(session_id="s", task="[1, 2]"), "task: must be a JSON object, got list"),
        (pb.ResetRequest(session_id="s", task="{oops"), "task: not valid JSON"),
        (pb.StepRequest(session_id="s"), "action: required"),
        (pb.StepRequest(session_id="s", action=pb.ChatMessage(role="user")), "action.role: must be 'assistant'"),
        (
            pb.StepRequest(
                session_id="s", action=pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(arguments="{}")])
            ),
            "action.tool_calls[0].name: must not be empty",
        ),
        (
            pb.StepRequest(
                session_id="s",
                action=pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="g", arguments="1")]),
            ),
            "action.tool_calls[0].arguments: must be a JSON object",
        ),
        (pb.CloseRequest(), "session_id: must not be empty"),
    ],
)
def test_bad_requests_name_the_field(request_, message: str) -> None:
    table = SessionTable(Counter)
    table.reset(pb.ResetRequest(session_id="s"))
    method = {pb.ResetRequest: table.reset, pb.StepRequest: table.step, pb.CloseRequest: table.close}[type(request_)]
    with pytest.raises(RelayError) as err:
        method(request_)
    assert err.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert str(err.value).startswith(message)
    table.shutdown()


def test_a_call_past_its_deadline_and_one_call_per_session() -> None:
    with LocalEnvironmentClient(AsyncCounter, timeout_s=0.2) as env:
        env.reset("s", {}, 0)
        with pytest.raises(EnvError) as err:
            env.step("s", {"role": "assistant", "content": "hang"})
        assert err.value.deadline and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert env.step("s", SAY).observations  # the cancelled coroutine released the session

    release = threading.Event()

    class Slow(Counter):
        def step(self, action: dict) -> Step:
            release.wait(10)
            return Counter.step(self, action)

    with LocalEnvironmentClient(Slow, timeout_s=0.2) as env:
        env.reset("s", {}, 0)
        assert code_of(lambda: env.step("s", SAY)) == grpc.StatusCode.DEADLINE_EXCEEDED  # a sync step runs on
        assert code_of(lambda: env.step("s", SAY)) == grpc.StatusCode.FAILED_PRECONDITION
        release.set()


class Broken(Environment):
    def reset(self, task: dict, seed: int | None):
        if task.get("kind") == "tuple":
            return ([], [])
        if task.get("kind") == "role":
            return Reset([{"role": "narrator", "content": "x"}])
        if task.get("kind") == "empty":
            return Reset([])
        return Reset([{"role": "user", "content": "go"}])

    def step(self, action: dict) -> Step:
        return Step([], reward=float("nan"), done=True)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("tuple", "Broken.reset returned tuple, not relayrl.env.Reset"),
        ("role", "Broken.reset().messages[0].role: 'narrator' is not one of"),
        ("empty", "Broken.reset().messages: must hold at least one message"),
    ],
)
def test_an_invalid_answer_of_the_environment_is_internal_and_named(kind: str, message: str) -> None:
    with LocalEnvironmentClient(Broken) as env:
        with pytest.raises(EnvError) as err:
            env.reset("s", {"kind": kind}, 0)
        assert err.value.code == grpc.StatusCode.INTERNAL and err.value.reason.startswith(message)


def test_a_nan_reward_is_refused() -> None:
    table = SessionTable(Broken)
    table.reset(pb.ResetRequest(session_id="s"))
    with pytest.raises(RelayError, match=r"step\(\)\.reward: nan is not a finite number"):
        table.step(pb.StepRequest(session_id="s", action=pb.ChatMessage(role="assistant")))
    table.shutdown()
