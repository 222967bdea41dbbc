"""The GuessNumber example environment, through LocalEnvironmentClient."""

from __future__ import annotations

import grpc
import pytest

from relayrl.env import EnvError, LocalEnvironmentClient
from relayrl.env.examples.guess import GUESS_TOOL, GuessNumber, secret_for


def guess_call(number, call_id: str = "call_0", name: str = "guess") -> dict:
    function = {"name": name, "arguments": {"number": number}}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


@pytest.fixture
def env():
    with LocalEnvironmentClient(GuessNumber, timeout_s=10) as client:
        yield client


def test_the_seed_fixes_the_secret_and_a_task_overrides_it() -> None:
    assert [secret_for(s) for s in range(20)] == [secret_for(s) for s in range(20)]
    assert len({secret_for(s) for s in range(50)}) == 8  # every number in [1, 8] occurs


def test_binary_search_with_tool_calls_wins(env) -> None:
    for seed in range(8):
        opening = env.reset(f"s{seed}", {}, seed)
        assert [m["role"] for m in opening.messages] == ["system", "user"]
        assert opening.messages[1]["content"] == "Guess my number between 1 and 8."
        assert opening.tools == [GUESS_TOOL]
        low, high, turns = 1, 8, 0
        while True:
            mid = (low + high) // 2
            step = env.step(f"s{seed}", guess_call(mid, f"call_{turns}"))
            turns += 1
            assert step.observations == [
                {
                    "role": "tool",
                    "content": step.observations[0]["content"],
                    "tool_call_id": f"call_{turns - 1}",
                    "name": "guess",
                }
            ]
            reply = step.observations[0]["content"]
            if reply == "correct":
                assert (step.done, step.truncated, step.reward) == (True, False, 1.0)
                assert mid == secret_for(seed)
                break
            assert (step.done, step.reward) == (False, None)
            low, high = (mid + 1, high) if reply == "higher" else (low, mid - 1)
        assert turns <= 4
        env.close(f"s{seed}")


def test_plain_text_guesses_and_truncation(env) -> None:
    env.reset("s", {"secret": 5, "max_turns": 3}, seed=None)
    first = env.step("s", {"role": "assistant", "content": "My guess is 2."})
    assert first.observations == [{"role": "user", "content": "higher"}]
    second = env.step("s", {"role": "assistant", "content": "hmm"})
    assert second.observations == [{"role": "user", "content": "Say a number from 1 to 8."}]
    last = env.step("s", {"role": "assistant", "content": "7"})
    assert last.observations[0]["content"] == "lower"
    assert (last.done, last.truncated, last.reward) == (False, True, 0.0)
    assert env.close("s", "") == 0.0


def test_bad_calls_are_observations_and_bad_tasks_are_refused(env) -> None:
    env.reset("s", {"secret": 3}, 0)
    assert env.step("s", guess_call(3, name="peek")).observations[0]["content"].startswith("unknown tool 'peek'")
    assert env.step("s", guess_call("x")).observations[0]["content"] == "number must be an integer from 1 to 8"
    assert env.step("s", {"role": "assistant", "content": "9" * 5000}).observations[0]["content"] == "lower"
    assert env.step("s", guess_call("-" + "9" * 5000)).observations[0]["content"] == "higher"
    assert env.step("s", guess_call("3")).reward == 1.0  # a number sent as text still counts
    assert env.close("s", "max_turns") == 0.0
    with pytest.raises(EnvError) as err:
        env.reset("t", {"secret": 9}, 0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.reason.startswith("task.secret")
