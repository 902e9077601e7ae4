"""What one agent turn produced, whole or delta by delta: reasoning, content, tool calls, why it ended
and how many of its tokens were reasoning. The stream's deltas put together are the whole output
(the parsers' guarantee, output_parser.py), so an API's streamed and whole answers agree.

    decoder = plan.decoder()                 # one per output (choice)
    for out in engine_outputs:               # each engine step's RequestOutput
        delta = decoder.step(out)            # TurnDelta: reasoning, content, tool_calls, finish_reason
    whole = plan.output(last_out)            # TurnOutput of the finished output

`finish_reason` is the engine's ("stop", "length", "abort", "error"), except that a turn ended by
the model ("stop") after it made calls ends with "tool_calls". Reasoning tokens are the output's
tokens up to the end of its `<think>` block (`</think>` included; all of them when it never closes),
found by decoding prefixes of the output as the detokenizer does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tessera.infer.agents.output_parser import OutputParser, OutputStream
from tessera.infer.agents.reasoning import END, START
from tessera.infer.agents.text_reader import skip_space
from tessera.infer.agents.tool_calls import ToolCall, ToolCallDelta

Decode = Callable[[list[int]], str]  # token ids -> text, as the detokenizer decodes them


class EngineOutput(Protocol):
    """What the engine hands back each step (tessera/infer/engine/sequence.py's RequestOutput)."""

    delta: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class TurnOutput:
    """A finished turn: `content` is the text outside the reasoning and the calls ("" for none)."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    reasoning_tokens: int


@dataclass(frozen=True)
class TurnDelta:
    """What one engine step adds: text to append to the reasoning and the content, call deltas
    (tool_calls.py: a call's index, id and name, then its arguments), and the finish reason last."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.finish_reason)


def finish_reason(engine_reason: str | None, made_calls: bool) -> str:
    """The turn's finish reason: "tool_calls" where the model stopped after calling."""
    reason = engine_reason or "stop"
    return "tool_calls" if made_calls and reason == "stop" else reason


def reasoning_end(text: str, opened: bool) -> int:
    """Where the `<think>` block of an output ends (after `</think>`; the text's end when it never
    closes; 0 when there is none), as the reasoning parsers read it."""
    at = skip_space(text, 0)
    if text.startswith(START, at):
        at += len(START)
    elif opened:
        at = 0
    else:
        return 0
    end = text.find(END, at)
    return len(text) if end < 0 else end + len(END)


def reasoning_tokens(text: str, token_ids: list[int], decode: Decode, opened: bool) -> int:
    """How many of the output's tokens the reasoning took: the fewest whose decoded text reaches the
    end of the block (binary search: a prefix's text only grows)."""
    end = reasoning_end(text, opened)
    if end == 0:
        return 0
    if end >= len(text):
        return len(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


class TurnDecoder:
    """One output of a turn read as the engine produces it: `step(out)` for each step's output."""

    def __init__(self, parser: OutputParser, opened: bool, decode: Decode | None):
        self._stream: OutputStream = parser.stream(opened)
        self._opened, self._decode = opened, decode
        self._reads_reasoning = parser.reasoning is not None
        self.calls = 0
        self.reasoning_tokens = 0

    def step(self, out: EngineOutput) -> TurnDelta:
        piece = self._stream.finish(out.delta) if out.finished else self._stream.feed(out.delta)
        self.calls += sum(1 for d in piece.tool_calls if d.id is not None)
        if not out.finished:
            return TurnDelta(piece.reasoning, piece.content, piece.tool_calls)
        if self._reads_reasoning and self._decode is not None:
            self.reasoning_tokens = reasoning_tokens(out.text, out.token_ids, self._decode, self._opened)
        return TurnDelta(piece.reasoning, piece.content, piece.tool_calls, finish_reason(out.finish_reason,
                                                                                          self.calls > 0))


def whole_output(parser: OutputParser, out: EngineOutput, opened: bool, decode: Decode | None) -> TurnOutput:
    """A finished output read at once."""
    reasoning, content, calls = parser.parse(out.text, opened)
    count = 0
    if parser.reasoning is not None and decode is not None:
        count = reasoning_tokens(out.text, out.token_ids, decode, opened)
    return TurnOutput(reasoning, content, tuple(calls), finish_reason(out.finish_reason, bool(calls)), count)
