"""Hermes / Qwen tool-call parsing: every malformed call becomes an error observation, nothing raises; parallel
calls are answered in one grouped turn, in call order."""

from __future__ import annotations

import random

import pytest

from relayrl.episodes.toolcalls import ERROR_CHARS, merge_observations, parse_turn

TOOLS = [
    {"type": "function", "function": {"name": "guess", "parameters": {}}},
    {"type": "function", "function": {"name": "hint", "parameters": {}}},
]


def call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def test_plain_text_is_the_content():
    parsed = parse_turn("  It is 4. ", TOOLS, 1)
    assert parsed.message == {"role": "assistant", "content": "It is 4."}
    assert parsed.errors == [] and parsed.order == []


def test_calls_are_parsed_in_order_with_ids_and_dict_arguments():
    text = "Let me try." + call('\n{"name":"guess","arguments":{"number":4}}\n') + call('{"name": "hint"}')
    parsed = parse_turn(text, TOOLS, 2)
    assert parsed.message["content"] == "Let me try."
    assert parsed.calls == [
        {"id": "call_2_0", "type": "function", "function": {"name": "guess", "arguments": {"number": 4}}},
        {"id": "call_2_1", "type": "function", "function": {"name": "hint", "arguments": {}}},
    ]


def test_arguments_written_as_json_text_are_parsed():
    parsed = parse_turn(call('{"name": "guess", "arguments": "{\\"number\\": 4}"}'), TOOLS, 0)
    assert parsed.calls[0]["function"]["arguments"] == {"number": 4}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("{bad json", "not valid JSON"),
        ('["guess", 4]', "must be a JSON object, got list"),
        ('{"arguments": {}}', 'needs a "name" string'),
        ('{"name": 7}', 'needs a "name" string'),
        ('{"name": "shout", "arguments": {}}', "unknown tool 'shout'; tools: guess, hint"),
        ('{"name": "guess", "arguments": 5}', '"arguments" of guess must be an object, got int'),
        ('{"name": "guess", "arguments": "4 please"}', '"arguments" of guess is text that is not JSON'),
    ],
)
def test_a_bad_call_becomes_an_error_observation(body, why):
    parsed = parse_turn("ok " + call(body), TOOLS, 3)
    assert parsed.calls == [] and parsed.message["content"] == "ok"
    (error,) = parsed.errors
    assert error["role"] == "tool" and error["tool_call_id"] == "call_3_0"
    assert error["content"].startswith("error: ") and why in error["content"]


def test_an_unclosed_call_is_an_error_and_the_text_before_it_stays():
    parsed = parse_turn('I will call <tool_call>{"name": "guess", "argu', TOOLS, 1)
    assert parsed.message == {"role": "assistant", "content": "I will call"}
    assert "not closed" in parsed.errors[0]["content"]


def test_any_tool_name_passes_when_the_environment_offers_none():
    assert parse_turn(call('{"name": "anything"}'), [], 0).calls[0]["function"]["name"] == "anything"


def test_an_error_quotes_at_most_error_chars_of_the_body():
    parsed = parse_turn(call("{" + "x" * 10_000), TOOLS, 0)
    assert len(parsed.errors[0]["content"]) < ERROR_CHARS + 200


def test_parallel_answers_come_in_call_order_in_one_group():
    text = call('{"name": "guess", "arguments": {"number": 1}}') + call("{oops") + call('{"name": "hint"}')
    parsed = parse_turn(text, TOOLS, 4)
    assert parsed.order == ["call_4_0", "call_4_1", "call_4_2"]
    env_answer = [  # the environment answers its calls in another order, and adds a user message
        {"role": "tool", "content": "a hint", "tool_call_id": "call_4_2"},
        {"role": "user", "content": "two calls seen"},
        {"role": "tool", "content": "higher", "tool_call_id": "call_4_0"},
        {"role": "tool", "content": "stray", "tool_call_id": "call_9_9"},
    ]
    merged = merge_observations(parsed, env_answer)
    assert [m.get("tool_call_id") for m in merged] == ["call_4_0", "call_4_1", "call_4_2", None, "call_9_9"]
    assert merged[1]["content"].startswith("error: tool call is not valid JSON")


def test_random_markup_never_raises():
    rng = random.Random(0)
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"guess"',
        '"arguments"',
        "[",
        "]",
        "4",
        " ",
        "\n",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30)))
        parsed = parse_turn(text, TOOLS, 0)
        assert len(parsed.order) == len(parsed.calls) + len(parsed.errors)
        merge_observations(parsed, [])
