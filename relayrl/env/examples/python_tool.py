"""``PythonTool``: arithmetic questions the policy may answer with the help of a ``run_python`` tool.

A task row is ``{"question": "What is 317 * 29?", "answer": "9193"}`` (``arithmetic_tasks`` makes them). Each
policy turn either calls ``run_python({"code": ...})`` — the code runs in a separate process under the limits
of relayrl/runtime/sandbox.py (CPU time, memory, wall time, no network), and its exit code, stdout and stderr come
back as the tool result, truncated — or answers in plain text, which ends the episode: reward 1.0 when the
text contains the answer as a number of its own (``"9193"`` counts in "it is 9193.", not in "19193"), else 0.0.
``max_turns`` turns of tool calls truncate the episode with reward 0.0; ``close`` answers 0.0.
"""

from __future__ import annotations

import random
import re

from relayrl.env.base import Environment
from relayrl.env.types import Reset, Step
from relayrl.errors import InvalidArgument
from relayrl.runtime.sandbox import Limits, run_python

SYSTEM = "Answer the question. You may run Python with run_python; print what you need. Then state the answer."
RUN_PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run Python code; returns its exit code, stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
    },
}


def arithmetic_tasks(count: int, seed: int = 0) -> list[dict]:
    """``count`` rows {"question", "answer"}: products and sums of 2-4 digit numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 9999), rng.randint(10, 999)
        op = rng.choice("+*")
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a * b)})
    return rows


def contains_answer(text: str, answer: str) -> bool:
    """``answer`` occurs in ``text`` not as part of a longer number."""
    return re.search(rf"(?<![\d.]){re.escape(answer)}(?!\.?\d)", text) is not None


class PythonTool(Environment):
    name = "python-tool"
    max_turns = 4
    limits = Limits()

    def reset(self, task: dict, seed: int | None) -> Reset:
        for key in ("question", "answer"):
            if not isinstance(task.get(key), str) or not task[key]:
                raise InvalidArgument(f"task.{key}", "must be a non-empty string")
        self.answer, self.turns = task["answer"].strip(), 0
        return Reset(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}],
            tools=[RUN_PYTHON],
        )

    def step(self, action: dict) -> Step:
        self.turns += 1
        calls = action.get("tool_calls", [])
        if not calls:  # the final answer
            return Step([], reward=float(contains_answer(action["content"], self.answer)), done=True)
        observations, seconds = [], 0.0
        for call in calls:
            function = call["function"]
            code = function["arguments"].get("code")
            if function["name"] != "run_python":
                content = f"unknown tool {function['name'][:32]!r}: use run_python"
            elif not isinstance(code, str):
                content = 'run_python needs {"code": "<python source>"}'
            else:
                run = run_python(code, self.limits)
                content, seconds = run.as_text(), seconds + run.seconds
            observations.append({"role": "tool", "content": content, "tool_call_id": call["id"], "name": "run_python"})
        metrics = {"tool_calls": float(len(calls)), "tool_seconds": seconds}
        if self.turns >= self.max_turns:
            return Step(observations, reward=0.0, truncated=True, metrics=metrics)
        return Step(observations, metrics=metrics)

    def close(self, reason: str) -> float | None:
        return 0.0
