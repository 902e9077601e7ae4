"""Reasoning parsers by the names `--reasoning-parser` takes (vLLM's spellings): `deepseek_r1` and
`qwen3`. They split a `<think>` model's output into its reasoning (the server's `reasoning_content`)
and the rest (`content`), whole or delta by delta, the stream always equal to the whole parse.

    <think>
    The user wants ...
    </think>

    Paris.

is reasoning "The user wants ..." and content "Paris.". The reasoning is what lies between the
markers, less the newlines at either end, and the content what follows `</think>`, less the newlines
at its start: the inverse of how Qwen3's template writes a turn with `reasoning_content` back into
the conversation. Where the block is never closed (the output cut off), all of it is reasoning.

Where the block opens is the one thing the families differ in. A template whose generation prompt
ends in `<think>` has opened it before the model writes: everything up to `</think>` is reasoning,
though no `<think>` is in the output (one the model writes again at its start is dropped). DeepSeek-R1's
template does so (its prompt ends in `<｜Assistant｜><think>\\n`), so `deepseek_r1` assumes it;
Qwen3's does not (its model writes `<think>` itself, and with `enable_thinking: false` its prompt holds
an empty closed block, so the output has none and is all content), so `qwen3` assumes it only when
told: the Qwen3 thinking-only (2507) templates open it. The caller tells it as `prompt_opened`,
best from the rendered prompt (`opens_reasoning(prompt)`). Without the block opened by the prompt,
the output has a block only if it starts with `<think>` (after whitespace); otherwise it is content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tessera.config.errors import ConfigError, require
from tessera.infer.agents.text_reader import find_marker, skip_space, starts

START, END = "<think>", "</think>"


class ParsedReasoning(NamedTuple):
    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves a `<think>` block open for the model to continue."""
    return prompt.rstrip().endswith(START)


class ReasoningStream:
    """Splits one output as it is generated: `feed(delta)`, then `finish()`; each returns what the
    piece adds. `reasoning` and `content` hold everything so far."""

    def __init__(self, opened: bool):
        self._opened = opened
        self._text, self._pos = "", 0
        self._state = "start"  # start: block not decided yet | reasoning | content
        self._strip = False  # drop the newlines that start the current part
        self._held = ""  # newlines at the reasoning's end, kept until what follows them is known
        self.reasoning = ""
        self.content = ""

    @property
    def reasoning_done(self) -> bool:
        """True once the text that follows is content: the block closed, or there is none."""
        return self._state == "content"

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._advance(final=False)

    def finish(self, delta: str = "") -> ReasoningDelta:
        self._text += delta
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        if self._state == "start":
            self._decide_block(final)
        reasoning = content = ""
        if self._state == "reasoning":
            found = find_marker(self._text, self._pos, END, final)
            if found is not None:
                end, closed = found
                reasoning = self._reasoning(self._text[self._pos:end], closed or final)
                self._pos = end + len(END) if closed else end
                if closed:
                    self._state, self._strip = "content", True
        if self._state == "content":
            content = self._text[self._pos:]
            self._pos = len(self._text)
            if self._strip:
                content = content.lstrip("\n")
                self._strip = not content
        self._text, self._pos = self._text[self._pos:], 0  # keep only what is not decided yet
        self.reasoning += reasoning
        self.content += content
        return ReasoningDelta(reasoning, content)

    def _decide_block(self, final: bool) -> None:
        at = skip_space(self._text, self._pos)
        found = starts(self._text, at, START)
        if found is None and not final:
            return
        if found:
            self._pos = at + len(START)
        self._state = "reasoning" if found or self._opened else "content"
        self._strip = self._state == "reasoning"

    def _reasoning(self, piece: str, ended: bool) -> str:
        if self._strip:
            piece = piece.lstrip("\n")
            self._strip = not piece
        piece = self._held + piece
        body = piece.rstrip("\n")
        self._held = "" if ended else piece[len(body):]
        return body


@dataclass(frozen=True)
class ReasoningParser:
    """A `<think>` family by its `--reasoning-parser` name; `prompt_opens`: whether its template's
    generation prompt opens the block (what `prompt_opened=None` assumes)."""

    name: str
    prompt_opens: bool

    def stream(self, prompt_opened: bool | None = None) -> ReasoningStream:
        return ReasoningStream(self.prompt_opens if prompt_opened is None else prompt_opened)

    def parse(self, text: str, prompt_opened: bool | None = None) -> ParsedReasoning:
        stream = self.stream(prompt_opened)
        stream.finish(text)
        return ParsedReasoning(stream.reasoning, stream.content)


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", prompt_opens=True),
                                         ReasoningParser("qwen3", prompt_opens=False))}


def reasoning_parser(name: str, error: type[ConfigError] = ConfigError) -> ReasoningParser:
    """The parser named `name`; `error` names the option and the names there are."""
    require(name in REASONING_PARSERS, "--reasoning-parser", name, f"one of {', '.join(REASONING_PARSERS)}",
            error, sep=" ")
    return REASONING_PARSERS[name]
