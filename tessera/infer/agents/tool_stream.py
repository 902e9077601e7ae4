"""The tool-call parser of every format: a stream fed the model's text delta by delta; the whole parse
is the same stream handed the whole text as ended (`finish(text)`).

A format (hermes.py, llama3_json.py, mistral.py, deepseek_v3.py) says only what comes next from a
position of the text: `Content(end)` (plain text up to `end`), `Calls(end, calls)` (calls written up to
`end`; none for a marker that belongs to calls, such as the end of a group) or None (not decidable until
more text comes). With `final` (the output has ended) it always decides. What it decided holds for any
continuation of the text, which is why the stream equals the whole parse however the text is cut, and
never takes anything back: a call is sent once its end marker
(or the end of its JSON, where the format has no marker) has come and it has proven to be a call, as
one delta with its index, id and name and one with its whole arguments. Holding a call until then is
the price of exactness: text that only looks like a call (a marker in prose, a call cut off or
malformed) is content, in the stream as in the whole parse.

Content is the text outside the calls, less the whitespace around them (the newlines templates put
between calls and around them), except that content before and after a run of calls stays apart by
the whitespace that preceded the run (`A\n<call>\n<call>\nB` has content `A\nB`): trailing whitespace
is held back until what follows it is known.

The stream keeps only the text not yet decided (a call being written, a marker cut off), so feeding
a long output costs what its pieces cost; the format's JSON scan (`ScanSlot`, given to the format) is
cleared when the text is cut, so a call is read once even when its arguments are long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from tessera.infer.agents.json_scan import ScanSlot
from tessera.infer.agents.text_reader import NOT_CALL, WAIT, find_marker
from tessera.infer.agents.tool_calls import CallIds, ParsedTools, ToolCall, ToolCallDelta, ToolStreamDelta


class Content(NamedTuple):
    end: int


class Calls(NamedTuple):
    end: int
    calls: list[tuple[str, str]]  # (name, arguments)


class CallFormat(Protocol):
    """One output's reader of a call format, made as `fmt(slot)` with the stream's `ScanSlot`; it may
    keep state between decisions (in a group of calls, past the output's start), changed only by the
    steps it returns. Positions are in the text it is given: what was not decided before this delta."""

    def step(self, text: str, pos: int, final: bool) -> Content | Calls | None: ...


class MarkedFormat:
    """A format whose calls open with a marker (`MARKER`): plain text up to the marker; at it,
    `read_call(text, where the marker ends, final)` says Calls, WAIT or NOT_CALL (the marker is then
    plain text, and reading goes on after it)."""

    MARKER = ""

    def __init__(self, slot: ScanSlot) -> None:
        self._slot = slot

    def step(self, text: str, pos: int, final: bool) -> Content | Calls | None:
        found = find_marker(text, pos, self.MARKER, final)
        if found is None:
            return None
        i, at_marker = found
        if i > pos or not at_marker:
            return Content(i)
        read = self.read_call(text, pos + len(self.MARKER), final)
        if read is WAIT:
            return None
        return Content(pos + len(self.MARKER)) if read is NOT_CALL else read

    def read_call(self, text: str, pos: int, final: bool) -> Calls | bool | None:
        raise NotImplementedError


@dataclass(frozen=True)
class CallLayout:
    """How a format writes calls, as the family's chat template renders an assistant turn's
    `tool_calls`: `prefix`, then each call as `before` (with `{name}`), its arguments and `after`,
    joined by `separator`, then `suffix`. It is what a grammar constraining calls must produce."""

    prefix: str
    before: str
    after: str
    separator: str
    suffix: str

    def render(self, calls: list[tuple[str, str]]) -> str:
        """The text of `calls`, `(name, arguments JSON)` each."""
        parts = (self.before.replace("{name}", name) + arguments + self.after for name, arguments in calls)
        return self.prefix + self.separator.join(parts) + self.suffix


class ToolCallStream:
    """Parses one output as it is generated: `feed(delta)` for each piece of text, `finish()` once it
    has ended; each returns what the piece adds. `content` and `calls` hold everything so far."""

    def __init__(self, fmt: type, ids: CallIds):
        self._slot = ScanSlot()
        self._fmt: CallFormat = fmt(self._slot)
        self._ids = ids
        self._text, self._pos = "", 0  # the text not decided yet, and where the next decision starts
        self._held = ""  # trailing whitespace of content, kept until what follows it is known
        self._after_call = False  # drop the whitespace that starts the next content
        self.content = ""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> ToolStreamDelta:
        self._text += delta
        return self._advance(final=False)

    def finish(self, delta: str = "") -> ToolStreamDelta:
        self._text += delta
        out = self._advance(final=True)
        tail, self._held = ("" if self._after_call else self._held), ""
        self.content += tail
        return ToolStreamDelta(out.content + tail, out.tool_calls)

    def _advance(self, final: bool) -> ToolStreamDelta:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._pos < len(self._text):
            step = self._fmt.step(self._text, self._pos, final)
            if step is None:
                assert not final, f"{type(self._fmt).__name__} left the end of an output undecided"
                break
            assert step.end > self._pos, f"{type(self._fmt).__name__} made no progress at {self._pos}"
            if isinstance(step, Calls):
                self._after_call = True
                deltas.extend(self._add_calls(step.calls))
            else:
                content.append(self._content(self._text[self._pos:step.end]))
            self._pos = step.end
        if self._pos:
            self._text, self._pos = self._text[self._pos:], 0
            self._slot.clear()
        text = "".join(content)
        self.content += text
        return ToolStreamDelta(text, tuple(deltas))

    def _content(self, piece: str) -> str:
        if self._after_call:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._after_call = False  # the whitespace before the calls separates this content from that before
        piece = self._held + piece
        body = piece.rstrip()
        self._held = piece[len(body):]
        return body

    def _add_calls(self, calls: list[tuple[str, str]]) -> list[ToolCallDelta]:
        deltas = []
        for name, arguments in calls:
            call = ToolCall(self._ids(), name, arguments)
            index = len(self.calls)
            self.calls.append(call)
            deltas.append(ToolCallDelta(index, call.id, call.name, ""))
            deltas.append(ToolCallDelta(index, arguments=arguments))
        return deltas


@dataclass(frozen=True)
class ToolCallParser:
    """A call format by its `--tool-call-parser` name: its reader's class (`fmt(slot)`, one per
    output), how ids are made (`new_id`), and how the family's template writes calls (`layout`)."""

    name: str
    fmt: type
    new_id: CallIds
    layout: CallLayout

    def stream(self, ids: CallIds | None = None) -> ToolCallStream:
        """A stream for one output; `ids` gives each call's id (default: the format's random ids)."""
        return ToolCallStream(self.fmt, ids or self.new_id)

    def parse(self, text: str, ids: CallIds | None = None) -> ParsedTools:
        """A whole output: its content and calls."""
        stream = self.stream(ids)
        stream.finish(text)
        return ParsedTools(stream.content, stream.calls)
