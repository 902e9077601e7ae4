"""A model's output read as the server configured it: the reasoning parser first, then the tool-call
parser on the content that follows the reasoning, whole or streamed, either parser optional.

Calls are looked for only after the reasoning has ended: a call a model writes inside its `<think>`
block is part of its reasoning (and is returned there, not lost), as the families' templates treat it.
The stream feeds the tool-call stream exactly the content the reasoning stream lets through, so the
streamed result equals the whole parse as each parser's does.

    parser = output_parser("qwen3", "hermes")
    reasoning, content, calls = parser.parse(text, prompt_opened=opens_reasoning(prompt))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tessera.infer.agents.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream, reasoning_parser
from tessera.infer.agents.tool_calls import CallIds, ToolCall, ToolCallDelta, ToolStreamDelta
from tessera.infer.agents.tool_parsers import tool_call_parser
from tessera.infer.agents.tool_stream import ToolCallParser, ToolCallStream


class ParsedOutput(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class OutputDelta:
    """What one piece of the model's text adds: reasoning, content, call deltas (tool_stream.py)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class OutputStream:
    """One output as it is generated: `feed(delta)`, then `finish()`."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self._reasoning, self._tools = reasoning, tools

    @property
    def reasoning_done(self) -> bool:
        """True once the text that follows is past the reasoning (always, without a reasoning parser)."""
        return self._reasoning is None or self._reasoning.reasoning_done

    def feed(self, delta: str) -> OutputDelta:
        split = self._reasoning.feed(delta) if self._reasoning else ReasoningDelta(content=delta)
        tools = self._tools.feed(split.content) if self._tools else ToolStreamDelta(split.content)
        return OutputDelta(split.reasoning, tools.content, tools.tool_calls)

    def finish(self, delta: str = "") -> OutputDelta:
        split = self._reasoning.finish(delta) if self._reasoning else ReasoningDelta(content=delta)
        tools = self._tools.finish(split.content) if self._tools else ToolStreamDelta(split.content)
        return OutputDelta(split.reasoning, tools.content, tools.tool_calls)


@dataclass(frozen=True)
class OutputParser:
    """The parsers a server runs with (`--reasoning-parser`, `--tool-call-parser`), either None.
    `prompt_opened`: whether the prompt opened the reasoning block (reasoning.py); `ids`: call ids."""

    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None

    def stream(self, prompt_opened: bool | None = None, ids: CallIds | None = None) -> OutputStream:
        return OutputStream(self.reasoning.stream(prompt_opened) if self.reasoning else None,
                            self.tools.stream(ids) if self.tools else None)

    def parse(self, text: str, prompt_opened: bool | None = None, ids: CallIds | None = None) -> ParsedOutput:
        reasoning, content = self.reasoning.parse(text, prompt_opened) if self.reasoning else ("", text)
        if self.tools is None:
            return ParsedOutput(reasoning, content, [])
        content, calls = self.tools.parse(content, ids)
        return ParsedOutput(reasoning, content, calls)


def output_parser(reasoning: str | None = None, tools: str | None = None) -> OutputParser:
    """The parsers by their option names (None: that parser off); ConfigError for an unknown name."""
    return OutputParser(reasoning_parser(reasoning) if reasoning else None,
                        tool_call_parser(tools) if tools else None)
