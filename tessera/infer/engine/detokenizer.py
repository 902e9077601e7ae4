"""Incremental detokenization with stop strings, for streaming.

The completion text always equals the decode of all completion tokens (so multi-token characters
and byte-level merges come out right), but it is found by decoding a short window of recent
tokens, not all of them, so a token costs the same at the 10th as at the 10,000th. Two offsets
into the tokens are kept: `read`, up to which the text is settled (it ended on a whole character),
and `prefix` before it. A new token decodes `ids[prefix:]`; the text it adds is that decode less
the decode of `ids[prefix:read]` (the window's first tokens are decoded both times, so what a
decoder does at the start of a text, e.g. Llama's dropping of the first word's leading space, is
cancelled out). When the window's text grew and does not end in U+FFFD (an incomplete UTF-8
sequence) the offsets move on: `prefix` to `read`, `read` to the end (so the window grows only
while a run of tokens ends in broken UTF-8). Where the window's text does not begin with that of
its first tokens (byte-fallback bytes that make an earlier character invalid) that step decodes
all tokens, as before.

The window is used for the decoders whose text for a token depends only on the tokens just before
it and, at the start, on being first (`decodes_incrementally`, decided when a detokenizer is made:
HF fast tokenizers' ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip from the start, no
decoder, and Sequences of those: byte-level BPE such as GPT-2, Qwen, Llama 3 and SmolLM2, and
SentencePiece-style Llama and Gemma). Any other decoder (WordPiece, BPEDecoder, CTC, a custom
one), and an object that is not a HF tokenizer, keeps decoding all tokens at every token.

Only the part that can no longer change is released: text ending in U+FFFD is held back, and so
are the last `len(longest stop string) - 1` characters, which could still turn out to start a stop
string. When a stop string appears, the text is cut before it and generation stops; `matched` says
which (the one that starts first: the Messages API answers it as `stop_sequence`).
"""

from __future__ import annotations

import json
from typing import Protocol

import tokenizers

# Decoders whose text for a token depends only on the tokens just before it and on being first.
_WINDOW_SAFE_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse"})


class TextDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _safe_decoder(spec: dict) -> bool:
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_safe_decoder(part) for part in spec.get("decoders", []))
    if kind == "Strip":  # stripping from the end could change a text's end as tokens follow (not tried)
        return spec.get("stop", 0) == 0
    return kind in _WINDOW_SAFE_DECODERS


def decodes_incrementally(tokenizer: TextDecoder | None) -> bool:
    """Whether `tokenizer`'s text can be found from a window of recent tokens (a HF fast
    tokenizer, or a Tessera `Tokenizer` around one, whose decoder is window-safe)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    if not isinstance(backend, tokenizers.Tokenizer):
        return False
    decoder = backend.decoder
    return decoder is None or _safe_decoder(json.loads(decoder.__getstate__()))


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextDecoder | None, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.incremental = decodes_incrementally(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # decoded text, cut at a stop string once one is found
        self.sent = 0  # characters of `text` already released
        self.stopped = False
        self.matched: str | None = None  # the stop string the text was cut at
        self.prefix = self.read = 0  # the window's start; the end of the settled tokens
        self.settled = ""  # the text of ids[:read]
        self.prefix_text = ""  # the text of ids[prefix:read] decoded alone

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (generation must stop)."""
        if self.tokenizer is None or self.stopped:
            return self.stopped
        self.ids.append(token_id)
        before = len(self.text)
        self.text = self._window_text() if self.incremental else self._decode(self.ids)
        if self.stop:
            search_from = max(0, min(before, len(self.text)) - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window_text(self) -> str:
        """The text of all tokens, from the decode of ids[prefix:]; the offsets move on when the
        window ends on a whole character."""
        window = self._decode(self.ids[self.prefix:])
        if not window.startswith(self.prefix_text):  # an earlier character changed: decode everything
            return self._decode(self.ids)
        text = self.settled + window[len(self.prefix_text):]
        if len(window) > len(self.prefix_text) and not window.endswith("\ufffd"):
            self.prefix, self.prefix_text = self.read, self._decode(self.ids[self.read:])
            self.read, self.settled = len(self.ids), text
        return text

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
