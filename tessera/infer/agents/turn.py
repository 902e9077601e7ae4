"""One agent turn as the model is asked for it, whichever API asked: the conversation in a neutral
form, the tools offered, how the model may use them, and the chat template's extra variables.

A protocol module (Chat Completions: tessera/infer/api/openai_tools.py) checks its own request's
shape and builds an `AgentTurn`; the turn checks what every API shares, raising a `RequestError`
whose `field` is the request field at fault:

- at most MAX_TOOLS tools, each named by the tool-call formats' name rule (`NAME`: letters, digits,
  `_`, `-`, `.`, `:`; at most 128), names unique, a description of at most MAX_TOOL_DESCRIPTION_CHARS,
  parameters a JSON schema of an object (MAX_TOOL_SCHEMA_CHARS of JSON at most) that the grammar
  engine compiles (checked whenever llguidance is installed, so that a schema is refused before the
  model sees it, whether or not the turn is constrained);
- a named tool choice names an offered tool; `required` and a name need tools;
- a tool result answers a call an earlier assistant message made.

Refusals name fields by the turn's own words (`messages`, `tools`, `parameters`, `tool_choice`,
`tool_call_id`, `template_kwargs`); a protocol whose request spells one otherwise says so in
`AgentTurn.spelling` (the Messages API: `{"parameters": "input_schema", "tool_call_id": "tool_use_id"}`),
and a message that is not the request's `messages[i]` says where it came from in `TurnMessage.where`
(`messages[2].content[0]`), so that the 400 names the field as the client wrote it.

The conversation reaches the chat template as transformers' `apply_chat_template(messages,
tools=...)` hands it, whatever the API: messages are `{"role", "content"}` dicts, an assistant's calls
`tool_calls: [{"id", "type": "function", "function": {"name", "arguments": dict}}]` (arguments as
an object: templates `tojson` them), a tool result `{"role": "tool", "tool_call_id", "content"}`
(and `name` where known), an earlier turn's reasoning `reasoning_content` (Qwen3's templates write it
back); tools are `{"type": "function", "function": {"name", "description", "parameters"}}`. Those
are the templates' variables, not an API's fields.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import RequestError
from tessera.config.limits import MAX_TOOL_DESCRIPTION_CHARS, MAX_TOOL_SCHEMA_CHARS, MAX_TOOLS
from tessera.infer.agents.text_reader import NAME
from tessera.infer.api.quoting import brief

CHOICE_MODES = ("none", "auto", "required", "function")
# the variables (and rendering arguments) the server gives every template itself: template_kwargs
# may not set them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "documents", "chat_template",
                                         "special_tokens"})


def refuse(field: str, key: str, value: object, allowed: str) -> RequestError:
    """`key=value is invalid: allowed` (the value quoted briefly), naming request field `field`."""
    return RequestError(f"{key}={brief(value)} is invalid: {allowed}", field=field)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is the JSON schema of its arguments object;
    `strict` asks for its calls to be constrained even under `auto`."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None
    strict: bool = False

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates receive it (a function tool, as transformers passes it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`none` (no calls read), `auto` (the model decides), `required` (at least one call) or
    `function` (one call of the function `name`)."""

    mode: str
    name: str | None = None


@dataclass(frozen=True)
class PastCall:
    """A call an earlier assistant turn made: its id, function and arguments (an object)."""

    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class TurnMessage:
    """One message of the conversation. `content` is its text (None: an assistant turn that only
    called tools); `tool_calls` an assistant's calls; `tool_call_id` (and `name`, the function's,
    where known) a tool result's; `reasoning` an earlier assistant turn's reasoning, which some
    templates (Qwen3's `reasoning_content`) write back; `where`: where the request holds it, for
    refusals (None: `messages[i]`, i its place in the turn)."""

    role: str
    content: str | None = ""
    tool_calls: tuple[PastCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    where: str | None = None

    def template_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                   for c in self.tool_calls]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            entry["name"] = self.name
        if self.reasoning is not None:
            entry["reasoning_content"] = self.reasoning
        return entry


@dataclass(frozen=True)
class AgentTurn:
    """One turn asked of the model. `tool_choice` None is the APIs' default: `auto` where tools are
    offered, `none` otherwise; `parallel_tool_calls` False allows at most one call where calls are
    constrained; `template_kwargs` are extra variables of the chat template (`enable_thinking`);
    `spelling` maps the turn's field names to the request's where they differ (module docstring)."""

    messages: tuple[TurnMessage, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    spelling: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_tools(self.tools, self.spelled)
        _check_choice(self.choice, self.tools, self.spelled)
        _check_results(self.messages, self.spelled)
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.template_kwargs))
        if reserved:
            key = self.spelled("template_kwargs")
            raise refuse(key, key, reserved, "may not set the variables the server gives the template "
                         f"({', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})")

    def spelled(self, name: str) -> str:
        """The request's name of the turn's field `name`."""
        return self.spelling.get(name, name)

    @property
    def choice(self) -> ToolChoice:
        """The tool choice in force (the default resolved)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return ToolChoice("auto" if self.tools else "none")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_entry() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the template's `tools` variable (None when none are offered, as transformers passes)."""
        return [t.template_entry() for t in self.tools] or None


def _check_tools(tools: tuple[Tool, ...], spelled: Callable[[str], str]) -> None:
    field_ = spelled("tools")
    if len(tools) > MAX_TOOLS:
        raise refuse(field_, f"len({field_})", len(tools), f"at most {MAX_TOOLS} tools a request")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field_}[{i}]"
        if not (isinstance(tool.name, str) and NAME.fullmatch(tool.name)):
            raise refuse(field_, f"{where}.name", tool.name, "1 to 128 letters, digits, '_', '-', '.' or ':' "
                         "(the names the tool-call formats can write)")
        if tool.name in seen:
            raise refuse(field_, f"{where}.name", tool.name, "tool names must be unique")
        seen.add(tool.name)
        if tool.description is not None and len(tool.description) > MAX_TOOL_DESCRIPTION_CHARS:
            raise refuse(field_, f"{where}.description", tool.description,
                         f"at most {MAX_TOOL_DESCRIPTION_CHARS:,} characters")
        why = schema_problem(tool.parameters)
        if why is not None:
            raise refuse(field_, f"{where}.{spelled('parameters')}", tool.parameters, why)


def schema_problem(schema: object) -> str | None:
    """Why `schema` cannot be a tool's parameters (None when it can): an object's JSON schema, short
    enough, that the grammar engine compiles."""
    if not isinstance(schema, Mapping):
        return "must be a JSON schema (an object)"
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return "must be a JSON schema (plain JSON)"
    if len(text) > MAX_TOOL_SCHEMA_CHARS:
        return f"at most {MAX_TOOL_SCHEMA_CHARS:,} characters of JSON"
    if schema.get("type", "object") != "object":
        return "must describe the arguments object ('type': 'object')"
    return _compile_problem(text)


@functools.lru_cache(maxsize=1024)
def _compile_problem(schema_text: str) -> str | None:
    """The grammar engine's complaint about a schema (None: it compiles, or llguidance is not installed
    and constrained calls are refused anyway)."""
    try:
        import llguidance
    except ImportError:
        return None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(schema_text))
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as e:
        problem = str(e)
    return f"the schema does not compile: {problem[:300]}" if problem else None


def _check_choice(choice: ToolChoice, tools: tuple[Tool, ...], spelled: Callable[[str], str]) -> None:
    key = spelled("tool_choice")
    if choice.mode not in CHOICE_MODES:
        raise refuse(key, key, choice.mode, "'none', 'auto', 'required' or a function")
    if choice.mode in ("required", "function") and not tools:
        raise refuse(key, key, choice.name or choice.mode, "needs tools to call; none are offered")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise refuse(key, key, choice.name, f"must name an offered tool ({brief([t.name for t in tools])})")


def _check_results(messages: tuple[TurnMessage, ...], spelled: Callable[[str], str]) -> None:
    """Every tool result answers a call made before it."""
    called: set[str] = set()
    field_ = spelled("messages")
    for i, m in enumerate(messages):
        called.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in called:
            where = m.where or f"{field_}[{i}]"
            raise refuse(field_, f"{where}.{spelled('tool_call_id')}", m.tool_call_id,
                         "must be the id of a call an earlier assistant message made")
