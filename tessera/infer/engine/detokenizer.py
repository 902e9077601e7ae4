"""Incremental detokenization with stop strings, for streaming.

The completion text is re-decoded from all completion tokens (so multi-token characters and
byte-level merges come out right), and only the part that can no longer change is released:
text ending in an incomplete UTF-8 sequence (U+FFFD) is held back, and so are the last
`len(longest stop string) - 1` characters, which could still turn out to start a stop string.
When a stop string appears, the text is cut before it and generation stops; `matched` says which
(the one that starts first: the Messages API answers it as `stop_sequence`).
"""

from __future__ import annotations

from typing import Protocol


class TextDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextDecoder | None, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded text, cut at a stop string once one is found
        self.sent = 0  # characters of `text` already released
        self.stopped = False
        self.matched: str | None = None  # the stop string the text was cut at

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (generation must stop)."""
        if self.tokenizer is None or self.stopped:
            return self.stopped
        self.ids.append(token_id)
        before = len(self.text)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if self.stop:
            search_from = max(0, min(before, len(self.text)) - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def release(self, final: bool) -> str:
        """The text that became safe to send since the last call (everything, when `final`)."""
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out
