"""Chat messages and tools: Python dicts (what chat templates read) <-> environment.proto messages.

A message is an OpenAI / Hugging Face chat-template dict::

    {"role": "assistant", "content": "...",
     "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "guess", "arguments": {"number": 4}}}]}
    {"role": "tool", "content": "higher", "tool_call_id": "call_0", "name": "guess"}

and a tool ``{"type": "function", "function": {"name", "description", "parameters": <JSON schema dict>}}``.

``arguments`` is a dict on the Python side and JSON text on the wire (``ToolCall.arguments``). It has to be a
dict for the chat template: Qwen2.5's template renders ``{{- tool_call.arguments | tojson }}`` unconditionally,
so a JSON *string* would be rendered a second time as a quoted, escaped string (``"arguments": "{\\"number\\": 4}"``)
— text the model never sampled. (Qwen3's template tests ``arguments is string`` and passes a string through;
Llama 3.1's also applies ``tojson`` unconditionally.) ``message_from_proto`` therefore always parses arguments
into a dict; ``message_to_proto`` accepts a dict or JSON-object text. Tool ``parameters`` likewise: a dict in
Python (the template renders the whole tool with ``tojson``), JSON text on the wire.

A dict built from the wire carries only the keys that mean something: ``role`` and ``content`` always,
``tool_calls`` when there are calls, ``tool_call_id`` and ``name`` when set. Every conversion error is an
``InvalidArgument`` naming the field (``action.tool_calls[0].arguments: not a JSON object``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from relayrl.errors import InvalidArgument
from relayrl.v1 import environment_pb2 as pb

ROLES = ("system", "user", "assistant", "tool")
NO_PARAMETERS = {"type": "object", "properties": {}}


def parse_json_object(field: str, text: str, *, empty: dict | None = None) -> dict:
    """``text`` parsed as a JSON object; empty text gives ``empty`` (default {})."""
    if not text:
        return dict(empty if empty is not None else {})
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(field, f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def _json_object_text(field: str, value) -> str:
    if isinstance(value, str):
        parse_json_object(field, value)
        return value
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be a dict or JSON-object text, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(field, f"not JSON-serialisable ({err})") from None


def _text(field: str, value, *, allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(field, f"must be a string, got {type(value).__name__}")
    return value


def message_to_proto(message: dict, field: str = "message") -> pb.ChatMessage:
    """A chat-template dict as a ``ChatMessage`` (content None, as OpenAI writes a pure tool-call turn, is "")."""
    if not isinstance(message, dict):
        raise InvalidArgument(field, f"must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidArgument(f"{field}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    out = pb.ChatMessage(role=role, content=_text(f"{field}.content", message.get("content"), allow_none=True))
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InvalidArgument(f"{field}.tool_calls", f"must be a list, got {type(calls).__name__}")
    if calls and role != "assistant":
        raise InvalidArgument(f"{field}.tool_calls", f"only an assistant message makes tool calls, not {role!r}")
    for i, call in enumerate(calls):
        where = f"{field}.tool_calls[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidArgument(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        function = call["function"]
        name = _text(f"{where}.function.name", function.get("name"))
        if not name:
            raise InvalidArgument(f"{where}.function.name", "must not be empty")
        arguments = _json_object_text(f"{where}.function.arguments", function.get("arguments", {}))
        out.tool_calls.add(id=_text(f"{where}.id", call.get("id", "")), name=name, arguments=arguments)
    out.tool_call_id = _text(f"{field}.tool_call_id", message.get("tool_call_id", ""), allow_none=True)
    out.name = _text(f"{field}.name", message.get("name", ""), allow_none=True)
    return out


def message_from_proto(message: pb.ChatMessage, field: str = "message") -> dict:
    """A ``ChatMessage`` as a chat-template dict (``arguments`` parsed into a dict)."""
    if message.role not in ROLES:
        raise InvalidArgument(f"{field}.role", f"{message.role[:64]!r} is not one of {', '.join(ROLES)}")
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": parse_json_object(f"{field}.tool_calls[{i}].arguments", call.arguments),
                },
            }
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def tool_to_proto(tool: dict, field: str = "tool") -> pb.Tool:
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` as a ``Tool``."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise InvalidArgument(field, 'must be {"type": "function", "function": {"name", "description", "parameters"}}')
    if tool.get("type", "function") != "function":
        raise InvalidArgument(f"{field}.type", f"must be 'function', got {tool.get('type')!r}")
    function = tool["function"]
    name = _text(f"{field}.function.name", function.get("name"))
    if not name:
        raise InvalidArgument(f"{field}.function.name", "must not be empty")
    return pb.Tool(
        name=name,
        description=_text(f"{field}.function.description", function.get("description", ""), allow_none=True),
        parameters=_json_object_text(f"{field}.function.parameters", function.get("parameters", NO_PARAMETERS)),
    )


def tool_from_proto(tool: pb.Tool, field: str = "tool") -> dict:
    """A ``Tool`` as a chat-template dict; omitted parameters become an object schema without properties."""
    if not tool.name:
        raise InvalidArgument(f"{field}.name", "must not be empty")
    parameters = parse_json_object(f"{field}.parameters", tool.parameters, empty=NO_PARAMETERS)
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
    }


def messages_to_proto(messages: Sequence[dict], field: str) -> list[pb.ChatMessage]:
    if not isinstance(messages, (list, tuple)):
        raise InvalidArgument(field, f"must be a list of message dicts, got {type(messages).__name__}")
    return [message_to_proto(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def messages_from_proto(messages: Sequence[pb.ChatMessage], field: str) -> list[dict]:
    return [message_from_proto(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def tools_to_proto(tools: Sequence[dict], field: str) -> list[pb.Tool]:
    if not isinstance(tools, (list, tuple)):
        raise InvalidArgument(field, f"must be a list of tool dicts, got {type(tools).__name__}")
    return [tool_to_proto(t, f"{field}[{i}]") for i, t in enumerate(tools)]


def tools_from_proto(tools: Sequence[pb.Tool], field: str) -> list[dict]:
    return [tool_from_proto(t, f"{field}[{i}]") for i, t in enumerate(tools)]
