"""Chat Completions' agent fields, translated into one agent turn (tessera/infer/agents/turn_plan.py)
and its output back into OpenAI's shapes.

In: `tools` (`[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`),
`tool_choice` (`"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": N}}`),
`parallel_tool_calls`, `chat_template_kwargs` (vLLM's extra: variables of the chat template, as
`{"enable_thinking": false}`), and in `messages` an assistant's `tool_calls` (`id`, `type:
"function"`, `function.name`, `function.arguments`: JSON text of an object, or the object), a
`tool` message's `tool_call_id`, a message's `name` and an assistant's earlier `reasoning_content`.
Out: `message.content` (null where the turn made calls and wrote no text), `message.tool_calls`,
`message.reasoning_content` (where a reasoning parser is on); streamed, `delta.content`,
`delta.reasoning_content` and `delta.tool_calls` (a call's `index`, `id`, `type` and
`function.name` with its first `function.arguments` fragment, later fragments by `index`).
"""

from __future__ import annotations

import json
from typing import Any

from tessera.config.errors import RequestError
from tessera.infer.agents.tool_calls import ToolCallDelta
from tessera.infer.agents.turn import AgentTurn, PastCall, Tool, ToolChoice, TurnMessage
from tessera.infer.agents.turn_output import TurnDelta, TurnOutput
from tessera.infer.api.openai_protocol import ProtocolError, _field
from tessera.infer.api.quoting import brief

_SPELLING = {"template_kwargs": "chat_template_kwargs"}  # the turn's other field names are Chat Completions' own


def chat_turn(body: dict, messages: list[dict[str, str]]) -> AgentTurn:
    """The turn a chat request asks for; `messages` are its messages with their text content (image
    parts as markers: media.chat_images). ProtocolError naming the field at fault."""
    tools = _tools(body)
    choice = _tool_choice(body)
    parallel = _field(body, "parallel_tool_calls", bool, True)
    kwargs = _field(body, "chat_template_kwargs", dict, {})
    history = tuple(_message(i, raw, m) for i, (raw, m) in enumerate(zip(body["messages"], messages)))
    try:
        return AgentTurn(history, tools, choice, parallel, kwargs, spelling=_SPELLING)
    except RequestError as e:
        raise ProtocolError(str(e), param=e.field) from None


def _tools(body: dict) -> tuple[Tool, ...]:
    raw = _field(body, "tools", list, [])
    out = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        function = entry.get("function") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and entry.get("type") == "function" and isinstance(function, dict)):
            raise ProtocolError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                f"{{...}}}}}}, got {brief(entry)}", param="tools")
        name, description = function.get("name"), function.get("description")
        parameters, strict = function.get("parameters"), function.get("strict")
        if not isinstance(name, str):
            raise ProtocolError(f"{where}.function.name must be a string", param="tools")
        if description is not None and not isinstance(description, str):
            raise ProtocolError(f"{where}.function.description must be a string", param="tools")
        if strict is not None and not isinstance(strict, bool):
            raise ProtocolError(f"{where}.function.strict must be a boolean", param="tools")
        tool = Tool(name, description=description, strict=bool(strict))
        out.append(tool if parameters is None else Tool(name, parameters, description, bool(strict)))
    return tuple(out)


def _tool_choice(body: dict) -> ToolChoice | None:
    value = body.get("tool_choice")
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict) \
            and isinstance(function.get("name"), str):
        return ToolChoice("function", function["name"])
    raise ProtocolError(f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                        f"{{'name': ...}}}}, got {brief(value)}", param="tool_choice")


def _message(i: int, raw: dict, text: dict[str, str]) -> TurnMessage:
    """Message i of the request (`raw`) with its text (`text`)."""
    where = f"messages[{i}]"
    calls = tuple(_past_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(_list(raw, "tool_calls", where)))
    content: str | None = text["content"]
    if calls and raw.get("content") is None:
        content = None
    extras = {}
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ProtocolError(f"{where}.{key} must be a string", param="messages")
        extras[key] = value
    return TurnMessage(text["role"], content, calls, extras["tool_call_id"], extras["name"],
                       extras["reasoning_content"])


def _list(raw: dict, key: str, where: str) -> list:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(f"{where}.{key} must be a list", param="messages")
    return value


def _past_call(where: str, call: Any) -> PastCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(call.get("id"), str) and isinstance(function.get("name"), str)):
        raise ProtocolError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                            f"'arguments': ...}}}}", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        raise ProtocolError(f"{where}.function.arguments must be the JSON text of an object", param="messages")
    return PastCall(call["id"], function["name"], arguments)


def chat_message(out: TurnOutput, reasoning: bool) -> dict[str, Any]:
    """The `message` of a finished choice; `reasoning`: whether a reasoning parser is on."""
    message: dict[str, Any] = {"role": "assistant", "content": out.content if out.content or not out.tool_calls
                               else None}
    if reasoning:
        message["reasoning_content"] = out.reasoning or None
    if out.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": c.arguments}}
                                 for c in out.tool_calls]
    return message


def chat_delta(delta: TurnDelta) -> dict[str, Any]:
    """The `delta` of a streamed chunk (the deltas of one call in one step merged into one entry)."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    calls: list[dict[str, Any]] = []
    for d in delta.tool_calls:
        if calls and calls[-1]["index"] == d.index:
            calls[-1]["function"]["arguments"] += d.arguments
        else:
            calls.append(_call_delta(d))
    if calls:
        out["tool_calls"] = calls
    return out


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}


def usage_details(use: dict[str, int], reasoning_tokens: int) -> dict[str, Any]:
    """`usage` with `completion_tokens_details.reasoning_tokens`."""
    return {**use, "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
