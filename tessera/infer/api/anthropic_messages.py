"""Anthropic's Messages API (`POST /v1/messages`): a request translated into one agent turn
(tessera/infer/agents/turn.py) and its sampling parameters. The answer's shapes are anthropic_output.py's,
the route anthropic_route.py's.

Fields, as Anthropic's API reference spells them:

- `model`, `max_tokens` (required: a request without it is refused, as Anthropic's API refuses it),
  `temperature`, `top_p`, `top_k`, `stop_sequences` (at most 16), `stream`;
- `system`: a string or a list of `text` blocks, the conversation's first (system) message;
- `messages`: `user` and `assistant` turns, each `content` a string or a list of blocks. A user's
  blocks are `text` and `tool_result` (`tool_use_id`, `content` a string or `text` blocks, `is_error`);
  an assistant's are `text`, `tool_use` (`id`, `name`, `input`: an object) and `thinking` (`thinking`,
  `signature`; written back as the turn's reasoning where the template takes it). The last message
  is a user's: continuing an assistant's unfinished turn is not served;
- `tools`: `{"name", "description", "input_schema", "strict"}` (custom tools; Anthropic's server
  tools, such as web search, are not served); `tool_choice`: `{"type": "auto"}`, `{"type": "any"}`
  (at least one call), `{"type": "tool", "name": N}`, `{"type": "none"}`, each with
  `disable_parallel_tool_use`;
- `thinking`: `{"type": "enabled", "budget_tokens": N}`, `{"type": "adaptive"}` or
  `{"type": "disabled"}` sets the chat template's `enable_thinking` variable (Qwen3's switch; a
  template without it ignores it); `budget_tokens` is not enforced (max_tokens bounds the whole turn).

Blocks and fields the cache and billing use (`cache_control`, `citations`, `metadata`,
`service_tier`, ...) are accepted and have no effect. `container`, `mcp_servers` and
`output_config.format` are refused by name, since ignoring them would change the answer.

How the conversation reaches the chat template: each user turn's text blocks joined as one user
message; each `tool_result` a `tool` message answering its `tool_use_id` (named by the `tool_use` it
answers; `is_error: true` puts "Error: " before its text, the template having no field for it); an
assistant turn's text as its content, its `tool_use` blocks as its calls, its `thinking` as its
reasoning. A refusal names the field as the request spells it (`messages[1].content[0].tool_use_id`,
`tools[0].input_schema`) in its message, and its top-level field as `param`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.config.errors import RequestError
from tessera.infer.agents.turn import AgentTurn, PastCall, Tool, ToolChoice, TurnMessage
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.quoting import brief
from tessera.infer.sampling.params import SamplingParams

# the agent turn's field names as the Messages API spells them (turn.py: AgentTurn.spelling)
SPELLING = {"parameters": "input_schema", "tool_call_id": "tool_use_id", "template_kwargs": "thinking"}
MAX_STOP_SEQUENCES = 16
UNSERVED = ("container", "mcp_servers")  # fields whose value would change the answer, refused unless null
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
_NUMBER = (int, float)


@dataclass(frozen=True)
class MessagesRequest:
    """One Messages request: the turn asked of the model, its sampling parameters (without the turn's
    constraint: `TurnPlan.sampling` adds it), whether to stream, and the `model` named (None: unset)."""

    turn: AgentTurn
    params: SamplingParams
    stream: bool
    model: str | None


def refuse(param: str, message: str) -> ProtocolError:
    return ProtocolError(message, param=param)


def messages_request(body: dict[str, Any]) -> MessagesRequest:
    """The request `body` (a JSON object) read; ProtocolError naming the field at fault."""
    for key in UNSERVED:
        if body.get(key) is not None:
            raise refuse(key, f"{key} is not served by this server (leave it unset)")
    output_config = _typed(body, "output_config", dict, {})
    if output_config.get("format") is not None:
        raise refuse("output_config", "output_config.format is not served by this server (leave it unset)")
    history = _system(body) + _conversation(body)
    tools = _tools(body)
    choice, parallel = _tool_choice(body)
    try:
        turn = AgentTurn(history, tools, choice, parallel, _thinking(body), spelling=SPELLING)
    except RequestError as e:
        raise refuse(e.field or "messages", str(e)) from None
    model = _typed(body, "model", str, None)
    return MessagesRequest(turn, sampling_params(body), _typed(body, "stream", bool, False), model)


def _typed(body: dict, key: str, types: type | tuple, default: Any, where: str | None = None) -> Any:
    """`body[key]` of one of `types` (booleans only where bool is one), `default` when absent or
    null; `where` names it in the message (default `key`), the top-level field is `param`."""
    value = body.get(key)
    if value is None:
        return default
    kinds = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
                 dict: "an object"}
        raise refuse((where or key).split(".")[0].split("[")[0],
                     f"{where or key}={brief(value)} is invalid: must be {' or '.join(names[k] for k in kinds)}")
    return value


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """`max_tokens` (required), `temperature`, `top_p`, `top_k`, `stop_sequences`."""
    if body.get("max_tokens") is None:
        raise refuse("max_tokens", "max_tokens is required (the most tokens the answer may have, an integer >= 1)")
    max_tokens = _typed(body, "max_tokens", int, None)
    stop = _typed(body, "stop_sequences", list, [])
    if len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
        raise refuse("stop_sequences", f"stop_sequences={brief(stop)} is invalid: must be at most "
                     f"{MAX_STOP_SEQUENCES} non-empty strings")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(_typed(body, "temperature", _NUMBER, 1.0)),
                              top_p=float(_typed(body, "top_p", _NUMBER, 1.0)), top_k=_typed(body, "top_k", int, 0),
                              stop=stop)
    except RequestError as e:  # the names are the Messages API's own
        raise refuse(e.field or "max_tokens", str(e)) from None


def _text_blocks(value: Any, where: str, param: str) -> str:
    """A string, or a list of `text` blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise refuse(param, f"{where}={brief(value)} is invalid: must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(value):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise refuse(param, f"{where}[{j}]={brief(block)} is invalid: must be a text block "
                         "({'type': 'text', 'text': ...})")
        parts.append(block["text"])
    return "".join(parts)


def _system(body: dict) -> tuple[TurnMessage, ...]:
    if body.get("system") is None:
        return ()
    return (TurnMessage("system", _text_blocks(body["system"], "system", "system"), where="system"),)


def _conversation(body: dict) -> tuple[TurnMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise refuse("messages", f"messages={brief(messages)} is invalid: must be a non-empty list of "
                     "{'role': 'user' or 'assistant', 'content': ...}")
    out: list[TurnMessage] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise refuse("messages", f"{where}.role={brief(role)} is invalid: must be 'user' or 'assistant' "
                         "(the system prompt is the top-level 'system')")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise refuse("messages", f"{where}.content={brief(content)} is invalid: must be a string or a list "
                         "of content blocks")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if role == "assistant":
            turn = _assistant(where, blocks)
            names.update((c.id, c.name) for c in turn.tool_calls)
            out.append(turn)
        else:
            out.extend(_user(where, blocks, names))
    if messages[-1]["role"] != "user":
        raise refuse("messages", f"messages[{len(messages) - 1}].role='assistant' is invalid: the last message "
                     "must be the user's (continuing an assistant's turn is not served)")
    return tuple(out)


def _block(where: str, block: Any, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise refuse("messages", f"{where}.type={brief(kind)} is invalid: this message's blocks are "
                     f"{', '.join(repr(a) for a in allowed)}")
    return kind


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise refuse("messages", f"{where}.{key}={brief(value)} is invalid: must be a string")
    return value


def _user(where: str, blocks: list, names: dict[str, str]) -> list[TurnMessage]:
    """A user turn: its text blocks as user messages, its tool results as tool messages, in order."""
    out: list[TurnMessage] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _block(at, block, ("text", "tool_result")) == "text":
            text.append(_string(block, "text", at))
            continue
        if text:
            out.append(TurnMessage("user", "".join(text), where=where))
            text = []
        call_id = _string(block, "tool_use_id", at)
        result = "" if block.get("content") is None else _text_blocks(block["content"], f"{at}.content", "messages")
        is_error = _typed(block, "is_error", bool, False, where=f"{at}.is_error")
        if is_error:
            result = f"Error: {result}" if result else "Error"
        out.append(TurnMessage("tool", result, tool_call_id=call_id, name=names.get(call_id), where=at))
    if text or not out:
        out.append(TurnMessage("user", "".join(text), where=where))
    return out


def _assistant(where: str, blocks: list) -> TurnMessage:
    """An assistant turn: its text, its calls (`tool_use`) and its reasoning (`thinking`)."""
    text: list[str] = []
    thought: list[str] = []
    calls: list[PastCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block(at, block, ("text", "tool_use", "thinking"))
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "thinking":
            thought.append(_string(block, "thinking", at))
        else:
            call_input = block.get("input", {})
            if not isinstance(call_input, dict):
                raise refuse("messages", f"{at}.input={brief(call_input)} is invalid: must be an object (the "
                             "tool's arguments)")
            calls.append(PastCall(_string(block, "id", at), _string(block, "name", at), call_input))
    content = "".join(text) if text or not calls else None
    return TurnMessage("assistant", content, tuple(calls), reasoning="".join(thought) if thought else None,
                       where=where)


def _tools(body: dict) -> tuple[Tool, ...]:
    out = []
    for i, entry in enumerate(_typed(body, "tools", list, [])):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise refuse("tools", f"{where}={brief(entry)} is invalid: must be {{'name': ..., 'input_schema': "
                         "{...}}")
        if entry.get("type") not in (None, "custom"):
            raise refuse("tools", f"{where}.type={brief(entry.get('type'))} is invalid: only custom tools "
                         "({'name', 'description', 'input_schema'}) are served, not Anthropic's server tools")
        name, description = entry.get("name"), entry.get("description")
        if not isinstance(name, str):
            raise refuse("tools", f"{where}.name={brief(name)} is invalid: must be a string")
        if description is not None and not isinstance(description, str):
            raise refuse("tools", f"{where}.description={brief(description)} is invalid: must be a string")
        if "input_schema" not in entry:
            raise refuse("tools", f"{where}.input_schema is required (the JSON schema of the tool's input)")
        strict = _typed(entry, "strict", bool, False, where=f"{where}.strict")
        out.append(Tool(name, entry["input_schema"], description, strict))
    return tuple(out)


def _tool_choice(body: dict) -> tuple[ToolChoice | None, bool]:
    """The tool choice (None: the default, auto where tools are offered) and whether calls may be parallel."""
    value = _typed(body, "tool_choice", dict, None)
    if value is None:
        return None, True
    kind = value.get("type")
    if kind not in _CHOICES:
        raise refuse("tool_choice", f"tool_choice.type={brief(kind)} is invalid: must be 'auto', 'any', 'tool' "
                     "or 'none'")
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise refuse("tool_choice", f"tool_choice.name={brief(name)} is invalid: type 'tool' needs the name "
                     "of an offered tool")
    single = _typed(value, "disable_parallel_tool_use", bool, False, where="tool_choice.disable_parallel_tool_use")
    return ToolChoice(_CHOICES[kind], name if kind == "tool" else None), not single


def _thinking(body: dict) -> dict[str, bool]:
    """The template's `enable_thinking`, from `thinking` (nothing when it is unset)."""
    value = _typed(body, "thinking", dict, None)
    if value is None:
        return {}
    kind = value.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise refuse("thinking", f"thinking.type={brief(kind)} is invalid: must be 'enabled', 'adaptive' or "
                     "'disabled'")
    _typed(value, "budget_tokens", int, None, where="thinking.budget_tokens")
    return {"enable_thinking": kind != "disabled"}
