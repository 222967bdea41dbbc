"""``GuessNumber``: find a secret number in [1, 8] (a task row may set ``high``: [1, high]) from "higher" / "lower"
answers.

The secret comes from the episode seed (``random.Random(seed)``: a GRPO group's episodes, sharing a seed, share
the secret); a task row ``{"secret": k}`` overrides it. Each policy turn guesses either with the tool call
``guess({"number": k})`` (answered by a tool result) or with plain text, whose first integer is the guess
(answered by a user message). "correct" ends the episode with reward 1.0; after ``max_turns`` turns without it
the environment truncates the episode with reward 0.0 (a task row may set ``max_turns``). An episode relayrl
ends early (``close`` with a reason) is worth 0.0. Several tool calls in one turn are answered in order. A task
row ``{"tools": false}`` offers no tool (plain-text guesses only: a prompt without the tool schema).
"""

from __future__ import annotations

import random
import re

from relayrl.env.base import Environment
from relayrl.env.types import Reset, Step
from relayrl.errors import InvalidArgument

LOW, HIGH = 1, 8
MAX_HIGH, MAX_TURNS = 10**6, 1000  # the largest range and turn limit a task row may ask for
SYSTEM = "Find the number. Call guess, or just say a number."
PROMPT = f"Guess my number between {LOW} and {HIGH}."
GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": f"Guess the number ({LOW}-{HIGH}).",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer", "minimum": LOW, "maximum": HIGH}},
            "required": ["number"],
        },
    },
}
_INTEGER = re.compile(r"-?\d+")


def secret_for(seed: int | None, high: int = HIGH) -> int:
    """The secret of an episode with ``seed`` (None: drawn from the OS) in [LOW, high]."""
    return random.Random(seed).randint(LOW, high)


def guess_tool(high: int) -> dict:
    """The ``guess`` tool of the range [LOW, high]."""
    if high == HIGH:
        return GUESS_TOOL
    function = dict(GUESS_TOOL["function"], description=f"Guess the number ({LOW}-{high}).")
    function["parameters"] = {
        "type": "object",
        "properties": {"number": {"type": "integer", "minimum": LOW, "maximum": high}},
        "required": ["number"],
    }
    return {"type": "function", "function": function}


def answer(secret: int, guess: int) -> str:
    return "correct" if guess == secret else ("higher" if secret > guess else "lower")


def parse_guess(text: str) -> int:
    """An integer's digits as a guess; past 18 digits only its sign matters (int() refuses over 4,300 digits)."""
    if len(text.lstrip("-")) > 18:
        return LOW - 1 if text.startswith("-") else 10**18
    return int(text)


def _int_field(task: dict, key: str, default: int, low: int, high: int) -> int:
    value = task.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"task.{key}", f"must be an integer in [{low}, {high}], got {value!r}")
    return value


class GuessNumber(Environment):
    name = "guess-number"
    max_turns = 6

    def reset(self, task: dict, seed: int | None) -> Reset:
        high = _int_field(task, "high", HIGH, LOW + 1, MAX_HIGH)
        secret = _int_field(task, "secret", secret_for(seed, high), LOW, high)
        limit = _int_field(task, "max_turns", self.max_turns, 1, MAX_TURNS)
        tools = task.get("tools", True)
        if not isinstance(tools, bool):
            raise InvalidArgument("task.tools", f"must be true or false, got {tools!r}")
        self.secret, self.high, self.limit, self.turns = secret, high, limit, 0
        prompt = PROMPT if high == HIGH else f"Guess my number between {LOW} and {high}."
        return Reset(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            tools=[guess_tool(high)] if tools else [],
        )

    def step(self, action: dict) -> Step:
        self.turns += 1
        observations, solved = [], False
        for call in action.get("tool_calls", []):
            reply = self._tool_reply(call["function"])
            solved |= reply == "correct"
            observations.append({"role": "tool", "content": reply, "tool_call_id": call["id"], "name": "guess"})
        if not observations:
            found = _INTEGER.search(action["content"])
            reply = (
                answer(self.secret, parse_guess(found.group())) if found else f"Say a number from {LOW} to {self.high}."
            )
            solved = reply == "correct"
            observations.append({"role": "user", "content": reply})
        metrics = {"solved": float(solved)}
        if solved:
            return Step(observations, reward=1.0, done=True, metrics=metrics)
        if self.turns >= self.limit:
            return Step(observations, reward=0.0, truncated=True, metrics=metrics)
        return Step(observations, metrics=metrics)

    def _tool_reply(self, function: dict) -> str:
        if function["name"] != "guess":
            return f"unknown tool {function['name'][:32]!r}: use guess"
        number = function["arguments"].get("number")
        if isinstance(number, str) and _INTEGER.fullmatch(number.strip()):
            number = parse_guess(number.strip())
        if not isinstance(number, int) or isinstance(number, bool):
            return f"number must be an integer from {LOW} to {self.high}"
        return answer(self.secret, number)

    def close(self, reason: str) -> float | None:
        return 0.0
