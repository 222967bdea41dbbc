"""Chat-template dicts <-> environment.proto messages, both ways, and what a template makes of arguments."""

from __future__ import annotations

import pytest

from relayrl.env.messages import (
    NO_PARAMETERS,
    message_from_proto,
    message_to_proto,
    tool_from_proto,
    tool_to_proto,
)
from relayrl.errors import InvalidArgument
from relayrl.v1 import environment_pb2 as pb

CALL = {"id": "call_0", "type": "function", "function": {"name": "guess", "arguments": {"number": 4}}}
GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}
# The tool-call loop of Qwen2.5's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), verbatim.
QWEN25_TOOL_CALLS = (
    "{%- for message in messages %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endfor %}"
)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess my number between 1 and 8."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "higher", "tool_call_id": "call_0", "name": "guess"},
    ],
)
def test_a_message_survives_the_round_trip(message: dict) -> None:
    wire = pb.ChatMessage.FromString(message_to_proto(message).SerializeToString())
    assert message_from_proto(wire) == message


def test_arguments_travel_as_json_text_and_come_back_a_dict() -> None:
    wire = message_to_proto({"role": "assistant", "content": None, "tool_calls": [CALL]})
    assert wire.content == ""  # OpenAI's None content of a pure tool-call turn
    assert wire.tool_calls[0].arguments == '{"number": 4}'
    as_text = {**CALL, "function": {"name": "guess", "arguments": '{"number": 4}'}}
    back = message_from_proto(message_to_proto({"role": "assistant", "content": "", "tool_calls": [as_text]}))
    assert back["tool_calls"][0]["function"]["arguments"] == {"number": 4}


def test_qwen25_template_needs_dict_arguments() -> None:
    """Qwen2.5 applies ``tojson`` to arguments unconditionally: a dict renders as the JSON the model samples, a
    string renders a second time, quoted and escaped. So messages_from_proto gives dicts."""
    from relayrl.models.tiny import build_tokenizer

    tok = build_tokenizer(QWEN25_TOOL_CALLS)
    as_dict = message_from_proto(message_to_proto({"role": "assistant", "content": "", "tool_calls": [CALL]}))
    rendered = tok.apply_chat_template([as_dict], tokenize=False)
    assert rendered == '\n<tool_call>\n{"name": "guess", "arguments": {"number": 4}}\n</tool_call>'
    as_text = {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {**CALL["function"]}}]}
    as_text["tool_calls"][0]["function"]["arguments"] = '{"number": 4}'
    assert '"arguments": "{\\"number\\": 4}"' in tok.apply_chat_template([as_text], tokenize=False)


def test_a_tool_survives_the_round_trip() -> None:
    assert tool_from_proto(pb.Tool.FromString(tool_to_proto(GUESS_TOOL).SerializeToString())) == GUESS_TOOL
    bare = tool_from_proto(pb.Tool(name="stop"))  # parameters omitted on the wire: no arguments
    assert bare == {"type": "function", "function": {"name": "stop", "description": "", "parameters": NO_PARAMETERS}}


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "bot", "content": "x"}, "action.role"),
        ({"role": "user", "content": 3}, "action.content"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "action.tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}, "action.tool_calls[0]"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "g", "arguments": "[1]"}}]},
            "action.tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "", "arguments": {}}}]},
            "action.tool_calls[0].function.name",
        ),
    ],
)
def test_a_bad_message_names_its_field(message: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        message_to_proto(message, "action")
    assert err.value.field == field


def test_bad_wire_messages_name_their_field() -> None:
    with pytest.raises(InvalidArgument, match=r"^observations\[1\]\.role"):
        message_from_proto(pb.ChatMessage(role="robot"), "observations[1]")
    call = pb.ToolCall(id="c", name="g", arguments="{not json")
    with pytest.raises(InvalidArgument, match=r"^m\.tool_calls\[0\]\.arguments: not valid JSON"):
        message_from_proto(pb.ChatMessage(role="assistant", tool_calls=[call]), "m")
    with pytest.raises(InvalidArgument, match=r"^tools\[0\]\.parameters: must be a JSON object"):
        tool_from_proto(pb.Tool(name="g", parameters="3"), "tools[0]")
