"""One JSON object or array read from text that is still growing: where it ends, whether it can still
become valid, and where each of its members (or elements) stands.

A tool-call parser must decide, with only part of a model's output, whether what follows a marker is a
call. `JsonScan` answers "complete, ending at `end`", "not JSON, whatever comes next" or "not known yet",
and resumes where it stopped when more text arrives, so a streamed call is read in one pass. It accepts
what `json.loads` accepts in its default strict mode, less NaN and the infinities (which are not JSON):
no control characters inside strings, no trailing commas, no single quotes. Only an object or an array
is accepted at the top, which is what every call format wraps its arguments in.
"""

from __future__ import annotations

import json
import re

PARTIAL, COMPLETE, INVALID = "partial", "complete", "invalid"

_WS = re.compile(r"[ \t\n\r]*")
# A string's body, unit by unit (possessive: a body that does not go on fails at once, no backtracking);
# a string the text's end cuts is resumed where its last whole unit ended.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+')
_ESCAPE_CUT = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_LIKE = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_CLOSES = {"{": "}", "[": "]"}


class JsonScan:
    """Reads the JSON object or array that starts at `start` of a text that only grows.

    `advance(text)` reads on from where the last call stopped and returns `status`: PARTIAL (the text
    ends inside the value), COMPLETE (it ends at `end`, exclusive) or INVALID (no continuation makes it
    JSON). `children` holds, for each value directly inside the top container, `(key, start, end)`:
    its member name (None in an array) and its span in the text.
    """

    def __init__(self, start: int):
        self.start = start
        self.pos = start
        self.status = PARTIAL
        self.end = -1
        self.children: list[tuple[str | None, int, int]] = []
        self._stack: list[str] = []  # the opening bracket of each container still open
        self._expect = "value"  # value | first_value | key | first_key | colon | after
        self._key: str | None = None
        self._child_start = -1
        self._string_start = -1  # where the string being read opened (-1: none)

    def advance(self, text: str) -> str:
        while self.status == PARTIAL:
            if self._string_start < 0:
                self.pos = _WS.match(text, self.pos).end()
            if self.pos >= len(text) or not self._token(text):
                break
        return self.status

    def members(self) -> dict[str, tuple[int, int]]:
        """A complete object's members: name -> span of its value (the last one of a repeated name,
        as `json.loads` keeps)."""
        return {key: (start, end) for key, start, end in self.children if key is not None}

    def _fail(self) -> bool:
        self.status = INVALID
        return False

    def _token(self, text: str) -> bool:
        """Read the token at `pos`; False when it fails or the text's end cuts it (`pos` then stays at
        its start, or inside a string after its last whole unit)."""
        if self._string_start >= 0:
            return self._string(text)
        c, expect = text[self.pos], self._expect
        if expect in ("key", "first_key"):
            if c == "}" and expect == "first_key":
                return self._close()
            return self._open_string(text) if c == '"' else self._fail()
        if expect == "colon":
            return self._step(1, "value") if c == ":" else self._fail()
        if expect == "after":
            if c == ",":
                return self._step(1, "key" if self._stack[-1] == "{" else "value")
            return self._close() if c == _CLOSES[self._stack[-1]] else self._fail()
        if c == "]" and expect == "first_value":
            return self._close()
        if c in _CLOSES:
            self._begin_value()
            self._stack.append(c)
            return self._step(1, "first_key" if c == "{" else "first_value")
        if not self._stack:
            return self._fail()  # a scalar at the top is no call's arguments
        if c == '"':
            self._begin_value()
            return self._open_string(text)
        end = _scalar_end(text, self.pos)
        if end is None:
            return False
        if end < 0:
            return self._fail()
        self._begin_value()
        self.pos = end
        self._end_value()
        return True

    def _step(self, width: int, expect: str) -> bool:
        self.pos += width
        self._expect = expect
        return True

    def _open_string(self, text: str) -> bool:
        self._string_start = self.pos
        self.pos += 1
        return self._string(text)

    def _string(self, text: str) -> bool:
        """Read on in the string that opened at `_string_start` (a key or a value, as `_expect` says)."""
        end = _STRING_BODY.match(text, self.pos).end()
        self.pos = end
        if end == len(text) or _ESCAPE_CUT.fullmatch(text, end):
            return False
        if text[end] != '"':
            return self._fail()
        start, self._string_start = self._string_start, -1
        self.pos = end + 1
        if self._expect not in ("key", "first_key"):
            self._end_value()
        elif len(self._stack) == 1:
            self._key, self._expect = json.loads(text[start:self.pos]), "colon"
        else:
            self._expect = "colon"
        return True

    def _begin_value(self) -> None:
        if len(self._stack) == 1:
            self._child_start = self.pos

    def _end_value(self) -> None:
        if len(self._stack) == 1:
            key = self._key if self._stack[0] == "{" else None
            self.children.append((key, self._child_start, self.pos))
        self._expect = "after"

    def _close(self) -> bool:
        self._stack.pop()
        self.pos += 1
        if not self._stack:
            self.status, self.end = COMPLETE, self.pos
            return False
        self._end_value()
        return True


def _scalar_end(text: str, pos: int) -> int | None:
    """End of the number or literal at `pos`: None when the text's end may still extend or complete
    it, -1 when it is invalid."""
    c = text[pos]
    if c in "-0123456789":
        like = _NUMBER_LIKE.match(text, pos).end()
        if like == len(text):
            return None  # `12` may go on as `123`
        return like if _NUMBER.fullmatch(text, pos, like) else -1
    word = _LITERALS.get(c)
    if word is None:
        return -1
    if text.startswith(word, pos):
        return pos + len(word)
    return None if word.startswith(text[pos:pos + len(word)]) and len(text) - pos < len(word) else -1


class ScanSlot:
    """The one JSON value a parser is reading at a time, kept across the stream's deltas so that it is
    read once: `at(start)` resumes the scan begun at `start`, or begins one there. Its owner clears it
when it cuts the text the positions refer to."""

    def __init__(self) -> None:
        self._scan: JsonScan | None = None

    def at(self, start: int) -> JsonScan:
        if self._scan is None or self._scan.start != start:
            self._scan = JsonScan(start)
        return self._scan

    def clear(self) -> None:
        """Forget the scan: the text it was reading has been cut away (positions have moved)."""
        self._scan = None
