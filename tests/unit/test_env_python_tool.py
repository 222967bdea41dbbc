"""The PythonTool episode: arithmetic with a ``run_python`` tool (its sandbox: tests/unit/test_sandbox.py)."""

from __future__ import annotations

from relayrl.env import LocalEnvironmentClient
from relayrl.env.examples.python_tool import PythonTool, arithmetic_tasks, contains_answer


def test_an_episode_with_the_tool_then_the_answer() -> None:
    task = {"question": "What is 317 * 29?", "answer": "9193"}
    with LocalEnvironmentClient(PythonTool, timeout_s=30) as env:
        opening = env.reset("s", task, 0)
        assert opening.messages[1]["content"] == "What is 317 * 29?"
        assert opening.tools[0]["function"]["name"] == "run_python"
        call = {
            "id": "c0",
            "type": "function",
            "function": {"name": "run_python", "arguments": {"code": "print(317*29)"}},
        }
        tool = env.step("s", {"role": "assistant", "content": "", "tool_calls": [call]})
        assert tool.observations == [
            {"role": "tool", "content": "exit code 0\nstdout:\n9193\n", "tool_call_id": "c0", "name": "run_python"}
        ]
        assert not tool.done and tool.metrics["tool_calls"] == 1.0
        final = env.step("s", {"role": "assistant", "content": "317 * 29 = 9193."})
        assert (final.done, final.reward, final.observations) == (True, 1.0, [])
        env.reset("wrong", task, 0)
        assert env.step("wrong", {"role": "assistant", "content": "19193"}).reward == 0.0


def test_tasks_and_answer_matching() -> None:
    rows = arithmetic_tasks(5, seed=1)
    assert rows == arithmetic_tasks(5, seed=1) and len({r["question"] for r in rows}) == 5
    for row in rows:
        a, op, b = row["question"].removeprefix("What is ").rstrip("?").split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert (
        contains_answer("so it is 42.", "42") and not contains_answer("420", "42") and not contains_answer("4.2", "2")
    )
