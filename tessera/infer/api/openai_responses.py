"""The Responses API's request (`POST /v1/responses`) translated into one agent turn
(tessera/infer/agents/turn.py) and its sampling parameters, field names as OpenAI's API reference
spells them; responses_output.py builds the answer, responses_route.py serves both.

Served fields:

- `input`: a string (one user message) or a list of items: messages (`{"type": "message", "role",
  "content"}`, `type` optional; roles `user`, `assistant`, `system`, `developer` (a system message
  to the template); content a string or `input_text` / `output_text` parts), `function_call`
  (`call_id`, `name`, `arguments`: JSON text of an object), `function_call_output` (`call_id`,
  `output`: a string or `input_text` parts) and `reasoning` (its `content`'s `reasoning_text`, which
  templates that write reasoning back receive). A reasoning item, an assistant message and the
  function calls that follow it make one assistant turn of the conversation, as a chat template
  expects. Any other item type, part type or role is refused, naming it (`input[2].type`).
- `instructions`: a system message before the conversation; a continuation does not inherit it.
- `previous_response_id`: the conversation of a stored response (response_store.py) before `input`;
  an id not stored (never, `store: false`, or evicted) is a 404 naming `previous_response_id`.
- `tools`: function tools in the Responses' flat shape `{"type": "function", "name", "description",
  "parameters", "strict"}`; `strict: true` constrains the tool's calls (absent is false here: a
  constrained call costs the grammar engine); hosted tools (`web_search`, ...) are refused.
- `tool_choice`: `none`, `auto`, `required` or `{"type": "function", "name"}`; `parallel_tool_calls`.
- `max_output_tokens` (default: what the context leaves), `temperature`, `top_p`, `stream`, `store`
  (default true), `text.format` (`text`, `json_object`, or `json_schema` with `name`, `schema`,
  `strict`: constrained as the chat's `response_format`), `metadata` (echoed), `reasoning` (echoed:
  whether and how long the model reasons is its chat template's and `--reasoning-parser`'s matter).

Fields whose feature the server lacks are refused unless they hold the value that means "off"
(`UNSUPPORTED`); other fields (`user`, `prompt_cache_key`, ...) mean nothing to a local server and
are ignored, as on the chat endpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import RequestError
from tessera.infer.agents.turn import AgentTurn, PastCall, Tool, ToolChoice, TurnMessage, refuse
from tessera.infer.api.openai_protocol import ProtocolError, _field
from tessera.infer.api.quoting import brief
from tessera.infer.api.response_store import ResponseStore
from tessera.infer.sampling.params import SamplingParams

_NUMBER = (int, float)
# the turn's field names as the Responses API spells them (refusals name the request's field)
SPELLING = {"messages": "input", "tool_call_id": "call_id"}
# an engine or SamplingParams field -> the Responses field it comes from
FIELDS = {"prompt": "input", "images": "input", "max_tokens": "max_output_tokens", "response_format": "text",
          "adapter": "model"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text")
# fields of features the server does not have, with the values that mean "off"
UNSUPPORTED = {"background": (False,), "conversation": (), "prompt": (), "top_logprobs": (0,),
               "max_tool_calls": (), "truncation": ("disabled",)}
# `include` entries that ask for nothing this server leaves out (reasoning is returned in clear)
INCLUDES = ("reasoning.encrypted_content",)


def protocol_error(e: RequestError) -> ProtocolError:
    """A refusal of the engine or the turn, naming the Responses field it comes from."""
    return ProtocolError(str(e), param=FIELDS.get(e.field, e.field))


def _refused(field: str, key: str, value: object, allowed: str) -> ProtocolError:
    """`key=value is invalid: allowed`, a 400 naming request field `field`."""
    return protocol_error(refuse(field, key, value, allowed))


@dataclass(frozen=True)
class ResponsesRequest:
    """One request translated: the turn, the conversation a stored response continues (the turn's
    messages less the instructions), the fields the response object repeats (`echo`), and how it is
    answered."""

    turn: AgentTurn
    history: tuple[TurnMessage, ...]
    echo: dict[str, Any]
    stream: bool
    store: bool
    max_output_tokens: int | None
    response_format: dict | None

    def sampling(self, room: int) -> SamplingParams:
        """The sampling parameters; `room`: the tokens the context leaves after the prompt."""
        try:
            return SamplingParams(max_tokens=self.max_output_tokens or max(1, room),
                                  temperature=float(self.echo["temperature"]), top_p=float(self.echo["top_p"]),
                                  response_format=self.response_format)
        except RequestError as e:
            raise protocol_error(e) from None


def responses_request(body: dict, store: ResponseStore) -> ResponsesRequest:
    """The request `body` translated; ProtocolError naming the field at fault."""
    _refuse_unsupported(body)
    previous_id = _field(body, "previous_response_id", str, None)
    earlier: tuple[TurnMessage, ...] = ()
    if previous_id is not None:
        stored = store.get(previous_id)
        if stored is None:
            raise ProtocolError(f"previous_response_id={brief(previous_id)} is not a stored response (never stored, "
                                "stored with store: false, or evicted)", status=404, param="previous_response_id")
        earlier = stored.conversation
    instructions = _field(body, "instructions", str, None)
    history = earlier + _conversation(body, earlier)
    system = (TurnMessage("system", instructions, where="instructions"),) if instructions is not None else ()
    tools, raw_tools = _tools(body)
    parallel = _field(body, "parallel_tool_calls", bool, True)
    try:
        turn = AgentTurn(system + history, tools, _tool_choice(body), parallel, spelling=SPELLING)
    except RequestError as e:
        raise protocol_error(e) from None
    max_output = _field(body, "max_output_tokens", int, None)
    if max_output is not None and max_output < 1:
        raise ProtocolError(f"max_output_tokens={max_output} is invalid: must be an integer >= 1",
                            param="max_output_tokens")
    text, response_format = _text_format(body)
    echo = {"instructions": instructions, "max_output_tokens": max_output,
            "metadata": _field(body, "metadata", dict, {}), "parallel_tool_calls": parallel,
            "previous_response_id": previous_id, "reasoning": _field(body, "reasoning", dict, None),
            "store": _field(body, "store", bool, True), "temperature": _field(body, "temperature", _NUMBER, 1.0),
            "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": raw_tools,
            "top_p": _field(body, "top_p", _NUMBER, 1.0), "truncation": "disabled"}
    return ResponsesRequest(turn, history, echo, _field(body, "stream", bool, False), echo["store"], max_output,
                            response_format)


def _refuse_unsupported(body: dict) -> None:
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value not in off:
            allowed = f"unset or {off[0]!r}" if off else "unset"
            raise ProtocolError(f"{key}={brief(value)} is invalid: this server does not support it ({allowed})",
                                param=key)
    include = _field(body, "include", list, [])
    unknown = [v for v in include if v not in INCLUDES]
    if unknown:
        raise ProtocolError(f"include={brief(unknown)} is invalid: this server includes nothing more "
                            f"(allowed: {', '.join(INCLUDES)})", param="include")


def _tools(body: dict) -> tuple[tuple[Tool, ...], list[dict]]:
    """The function tools, and the same as the response object repeats them."""
    raw = _field(body, "tools", list, [])
    tools, echoed = [], []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            kind = entry.get("type") if isinstance(entry, dict) else entry
            raise _refused("tools", f"{where}.type", kind, "'function' ({'type': 'function', 'name': ..., "
                         "'parameters': {...}}): this server runs no hosted tools")
        name, description, parameters = entry.get("name"), entry.get("description"), entry.get("parameters")
        strict = entry.get("strict")
        for key, value, kind in (("name", name, str), ("description", description, str),
                                 ("strict", strict, bool)):
            if (value is not None or key == "name") and not isinstance(value, kind):
                flat = " (the Responses API's tools are flat: {'type': 'function', 'name': ..., 'parameters': " \
                       "{...}})" if key == "name" else ""
                raise _refused("tools", f"{where}.{key}", value,
                             f"must be a {'boolean' if kind is bool else 'string'}{flat}")
        tool = Tool(name, description=description, strict=bool(strict))
        tools.append(tool if parameters is None else Tool(name, parameters, description, bool(strict)))
        echoed.append({"type": "function", "name": name, "description": description,
                       "parameters": tools[-1].parameters, "strict": bool(strict)})
    return tuple(tools), echoed


def _tool_choice(body: dict) -> ToolChoice | None:
    value = body.get("tool_choice")
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return ToolChoice("function", value["name"])
    raise _refused("tool_choice", "tool_choice", value, "'none', 'auto', 'required' or {'type': 'function', "
                 "'name': ...}")


def _text_format(body: dict) -> tuple[dict, dict | None]:
    """`text` as the response repeats it, and the `response_format` it asks for (None: free text)."""
    text = _field(body, "text", dict, {})
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {**text, "format": fmt}, None
    if kind == "json_object":
        return {**text, "format": fmt}, {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {**text, "format": fmt}, {"type": "json_schema", "json_schema": spec}
    raise _refused("text", "text.format", fmt, "{'type': 'text'}, {'type': 'json_object'} or {'type': "
                 "'json_schema', 'name': ..., 'schema': {...}}")


class _Turns:
    """The input items folded into the conversation's messages: a reasoning item, an assistant message
    and the calls after them make one assistant message."""

    def __init__(self, earlier: tuple[TurnMessage, ...]):
        self.messages: list[TurnMessage] = []
        self.open: TurnMessage | None = None  # the assistant message still taking items
        self.names = {c.id: c.name for m in earlier for c in m.tool_calls}  # call ids -> function names

    def close(self) -> None:
        if self.open is not None:
            open_ = self.open
            self.messages.append(open_ if open_.content is not None or open_.tool_calls
                                 else dataclasses.replace(open_, content=""))
            self.open = None

    def add(self, message: TurnMessage) -> None:
        self.close()
        self.messages.append(message)

    def assistant(self, where: str, content: str | None = None, reasoning: str | None = None) -> None:
        if content is not None and self.open is not None and self.open.content is None and not self.open.tool_calls:
            self.open = dataclasses.replace(self.open, content=content)
            return
        self.close()
        self.open = TurnMessage("assistant", content, reasoning=reasoning, where=where)

    def call(self, where: str, call: PastCall) -> None:
        if self.open is None:
            self.open = TurnMessage("assistant", None, where=where)
        self.open = dataclasses.replace(self.open, tool_calls=self.open.tool_calls + (call,))
        self.names[call.id] = call.name


def _conversation(body: dict, earlier: tuple[TurnMessage, ...]) -> tuple[TurnMessage, ...]:
    """The messages of `input`."""
    value = body.get("input")
    if isinstance(value, str):
        return (TurnMessage("user", value, where="input"),)
    if not isinstance(value, list) or not (value or earlier):
        raise ProtocolError(f"input={brief(value)} is invalid: must be a string or a non-empty list of items",
                            param="input")
    turns = _Turns(earlier)
    for k, item in enumerate(value):
        _item(turns, f"input[{k}]", item)
    turns.close()
    return tuple(turns.messages)


def _item(turns: _Turns, where: str, item: Any) -> None:
    if not isinstance(item, dict):
        raise _refused("input", where, item, "an item: an object with a 'type' (or a message's 'role')")
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise _refused("input", f"{where}.type", kind, f"one of {', '.join(ITEM_TYPES)} (this server runs "
                     "function tools only)")
    if kind == "message":
        role = ROLES.get(item.get("role"))
        if role is None:
            raise _refused("input", f"{where}.role", item.get("role"), f"one of {', '.join(ROLES)}")
        text = _text(f"{where}.content", item.get("content"), TEXT_PARTS)
        if role == "assistant":
            turns.assistant(where, content=text)
        else:
            turns.add(TurnMessage(role, text, where=where))
    elif kind == "reasoning":
        parts = item.get("content") or []
        turns.assistant(where, reasoning=_text(f"{where}.content", parts, ("reasoning_text",)) if parts else None)
    elif kind == "function_call":
        call_id, name = _string(item, "call_id", where), _string(item, "name", where)
        turns.call(where, PastCall(call_id, name, _arguments(f"{where}.arguments", item.get("arguments", "{}"))))
    else:
        call_id = _string(item, "call_id", where)
        output = _text(f"{where}.output", item.get("output"), ("input_text", "output_text"))
        turns.add(TurnMessage("tool", output, tool_call_id=call_id, name=turns.names.get(call_id), where=where))


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _refused("input", f"{where}.{key}", value, "must be a non-empty string")
    return value


def _text(where: str, content: Any, kinds: tuple[str, ...]) -> str:
    """A string, or the text of a list of parts of the types `kinds`, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refused("input", where, content, "must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _refused("input", f"{where}[{j}].type", kind if kind is not None else part,
                         f"a part {{'type': {' or '.join(repr(k) for k in kinds)}, 'text': ...}} (this server "
                         "takes text only)")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(where: str, arguments: Any) -> dict:
    value = None
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict):
        raise _refused("input", where, arguments, "must be the JSON text of an object")
    return value
