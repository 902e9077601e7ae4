"""What a tool-call parser hands the server: the calls a model made, in OpenAI's shape, whole or as the
deltas of a stream; call ids; and the one rule by which a JSON object is a call.

A call's `arguments` is the model's own text of a JSON object, kept verbatim (key order, spacing,
escapes and numbers as written) when the model wrote an object there, or the text of the string it
wrote there when that string holds a JSON object (some models quote their arguments). Either way it is
valid JSON that `json.loads` reads to a dict, and the streamed and the whole parse give the same text.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tessera.infer.agents.json_scan import JsonScan
from tessera.infer.agents.text_reader import NAME

CallIds = Callable[[], str]  # each call returns the id of the next call


@dataclass(frozen=True)
class ToolCall:
    """One call: OpenAI's `tool_calls[i]` with `id`, `function.name` and `function.arguments` (the
    JSON text of an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call, OpenAI's `delta.tool_calls[j]`: a call's first delta carries its
    `index` (its place among the output's calls), `id` and `name` with `arguments` ""; the next ones
    the same index and a fragment of `arguments`, to be appended."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ParsedTools(NamedTuple):
    """A whole output parsed: `content` is the text outside the calls ("" for none)."""

    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolStreamDelta:
    """What one delta of the model's text adds: content to append, and call deltas."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def openai_call_id() -> str:
    """`call_` and 24 random hex digits, as OpenAI's call ids look."""
    return "call_" + secrets.token_hex(12)


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine random letters and digits: Mistral's chat templates refuse any other id when the call
    comes back in the conversation."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def arguments_text(text: str, start: int, end: int) -> str | None:
    """The arguments written at `text[start:end]` as the JSON text of an object, or None when they are
    not an object (nor a string holding one's text)."""
    try:
        value = json.loads(text[start:end])
        if isinstance(value, str):
            return value if isinstance(json.loads(value), dict) else None
    except (ValueError, RecursionError):  # nested past what `json.loads` (and so a client) reads
        return None
    return text[start:end] if isinstance(value, dict) else None


def object_call(text: str, scan: JsonScan, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """`(name, arguments)` of the complete JSON object `scan` read, when it is a call: a `name` that
    is a function name (NAME) and arguments under the first of `argument_keys` it has (an object, or
    absent or null for none: "{}"). None when it is not a call."""
    if text[scan.start] != "{":
        return None
    members = scan.members()
    if "name" not in members:
        return None
    name = json.loads(text[slice(*members["name"])])
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return None
    for key in argument_keys:
        if key in members:
            start, end = members[key]
            if text[start:end] == "null":
                return name, "{}"
            arguments = arguments_text(text, start, end)
            return None if arguments is None else (name, arguments)
    return name, "{}"
