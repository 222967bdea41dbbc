"""Tool calls in a sampled turn, Qwen / Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

``parse_turn(text, tools, turn)`` splits a turn's text (special tokens removed) into the assistant message the
environment sees (``content`` with the markup removed, ``tool_calls`` with dict ``arguments``) and the calls that
failed. A call fails when its body is not JSON, not an object, has no string ``name``, names a tool the
environment does not offer (when it offers any), has ``arguments`` that are not an object (or JSON-object text),
or is a ``<tool_call>`` never closed (a turn cut short). Each failed call is answered by relayrl itself with a
tool message saying why (an *error observation*): the episode goes on, nothing raises. Call ids are
``call_<turn>_<index>`` in the order the calls appear, failed ones included, so the observations of one turn
answer its calls in order, in one grouped turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
ERROR_CHARS = 200  # the offending text quoted in an error observation, at most


@dataclass
class ParsedTurn:
    """A sampled turn: ``message`` for the environment, ``errors`` (tool messages, one per failed call), and
    ``order``: every call id in order of appearance (valid and failed)."""

    message: dict
    errors: list[dict] = field(default_factory=list)
    order: list[str] = field(default_factory=list)

    @property
    def calls(self) -> list[dict]:
        return self.message.get("tool_calls", [])


def _error(call_id: str, name: str, reason: str) -> dict:
    return {"role": "tool", "content": f"error: {reason}", "tool_call_id": call_id, "name": name}


def _parse_call(body: str, offered: set[str]) -> tuple[dict | None, str, str]:
    """(the call's function dict, "", name) or (None, why it failed, the name if one was read)."""
    try:
        value = json.loads(body)
    except ValueError as err:
        return None, f"tool call is not valid JSON ({err.msg} at char {err.pos}): {body.strip()[:ERROR_CHARS]}", ""
    if not isinstance(value, dict):
        return None, f"tool call must be a JSON object, got {type(value).__name__}", ""
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, 'tool call needs a "name" string', ""
    if offered and name not in offered:
        return None, f"unknown tool {name[:64]!r}; tools: {', '.join(sorted(offered))}", name
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None, f'"arguments" of {name} is text that is not JSON: {arguments[:ERROR_CHARS]}', name
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {name} must be an object, got {type(arguments).__name__}', name
    return {"name": name, "arguments": arguments}, "", name


def parse_turn(text: str, tools: Sequence[dict], turn: int) -> ParsedTurn:
    """The assistant message and error observations of one sampled turn (module docstring)."""
    offered = {t["function"]["name"] for t in tools if isinstance(t.get("function"), dict)}
    calls, errors, order, pieces, end = [], [], [], [], 0
    for match in _CALL.finditer(text):
        pieces.append(text[end : match.start()])
        end = match.end()
        call_id = f"call_{turn}_{len(order)}"
        order.append(call_id)
        function, reason, name = _parse_call(match.group(1), offered)
        if function is None:
            errors.append(_error(call_id, name, reason))
        else:
            calls.append({"id": call_id, "type": "function", "function": function})
    rest = text[end:]
    if OPEN in rest:  # a call opened and never closed: the turn was cut short mid-call
        at = rest.index(OPEN)
        call_id = f"call_{turn}_{len(order)}"
        order.append(call_id)
        errors.append(_error(call_id, "", f"tool call not closed with {CLOSE}: {rest[at:][:ERROR_CHARS]}"))
        rest = rest[:at]
    pieces.append(rest)
    message: dict = {"role": "assistant", "content": "".join(pieces).strip()}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors, order)


def merge_observations(parsed: ParsedTurn, observations: Sequence[dict]) -> list[dict]:
    """One grouped answer to a turn: a tool message for every call in call order (the environment's result, or
    relayrl's error observation), then the environment's other messages (a user message, results it sent for
    ids it was not asked about) in the order it sent them."""
    by_id = {e["tool_call_id"]: e for e in parsed.errors}
    results, rest = {}, []
    for message in observations:
        call_id = message.get("tool_call_id", "")
        answers_call = call_id in parsed.order and call_id not in by_id and call_id not in results
        if message.get("role") == "tool" and answers_call:
            results[call_id] = message
        else:
            rest.append(message)
    ordered = [by_id.get(call_id) or results.get(call_id) for call_id in parsed.order]
    return [m for m in ordered if m is not None] + rest
