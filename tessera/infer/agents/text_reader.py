"""Reading a model's output while it is still being written: where a marker starts, and a reader that
takes a call's pieces in order and says, when it stops, whether more text could still make a call.

Every decision made here holds for any continuation of the text: a marker found stays found, a piece
that differs from what was expected differs whatever follows, and where the text's end cuts a piece
the answer is "not known yet" (`WAIT`) until more text comes or the output ends (`final`). That is
what makes a streamed parse equal the parse of the whole text.
"""

from __future__ import annotations

import re

from tessera.infer.agents.json_scan import COMPLETE, INVALID, JsonScan, ScanSlot

WAIT = None  # not decidable yet: the text's end cuts what is being read
NOT_CALL = False  # what follows the marker is no call, whatever comes next
# A function name as the call formats write it bare (DeepSeek-V3's, Mistral's `[ARGS]` form) and as a
# JSON call must name it: OpenAI's letters, digits, `_` and `-`, and `.` and `:` that namespaced tools use.
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:-]*")
_SPACE = re.compile(r"\s*")


def find_marker(text: str, pos: int, marker: str, final: bool) -> tuple[int, bool] | None:
    """Where the text from `pos` on stops being plain text before `marker`: `(i, True)` where the
    marker starts at i, `(i, False)` where no marker is (i is the text's end, or where a cut-off start
    of the marker begins when more may come), None when that cut-off start is at `pos` itself."""
    i = text.find(marker, pos)
    if i >= 0:
        return i, True
    if not final:
        for k in range(min(len(marker) - 1, len(text) - pos), 0, -1):
            if text.endswith(marker[:k]):
                return (len(text) - k, False) if len(text) - k > pos else None
    return len(text), False


def starts(text: str, pos: int, literal: str) -> bool | None:
    """True where `literal` starts at `pos`, None where the text ends inside it, False otherwise."""
    if text.startswith(literal, pos):
        return True
    rest = text[pos:pos + len(literal)]
    return None if len(rest) < len(literal) and literal.startswith(rest) else False


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


class Reader:
    """Reads a call's pieces in order from `pos`; each method returns what it read (True for a
    literal), or a false value when the piece is not there, setting `cut` when the text's end is why.
    `outcome()` is then WAIT (more text may still make the call) or NOT_CALL."""

    def __init__(self, text: str, pos: int, final: bool, slot: ScanSlot):
        self.text, self.pos, self.final, self.slot = text, pos, final, slot
        self.cut = False

    def outcome(self) -> bool | None:
        return WAIT if self.cut and not self.final else NOT_CALL

    def space(self) -> bool:
        self.pos = skip_space(self.text, self.pos)
        return True

    def literal(self, literal: str) -> bool:
        found = starts(self.text, self.pos, literal)
        if found:
            self.pos += len(literal)
        self.cut = found is None
        return bool(found)

    def name(self) -> str:
        """A bare function name (NAME); "" when there is none."""
        end = _NAME_CHARS.match(self.text, self.pos).end()
        if end == len(self.text) and end - self.pos <= 128:
            self.cut = True  # the name may go on
            return ""
        name = self.text[self.pos:end]
        if not NAME.fullmatch(name):
            return ""
        self.pos = end
        return name

    def json(self, opening: str = "{") -> JsonScan | None:
        """The complete JSON value at `pos`, which must open with one of `opening`."""
        if self.pos == len(self.text):
            self.cut = True
            return None
        if self.text[self.pos] not in opening:
            return None
        scan = self.slot.at(self.pos)
        status = scan.advance(self.text)
        if status != COMPLETE:
            self.cut = status != INVALID
            return None
        self.pos = scan.end
        return scan
