"""What `tessera router --policy cache_aware` sent where: a bounded index from prompt prefixes to
the replicas that were sent them, so that a request goes where its longest prefix was computed
(and most likely still sits in that replica's prefix cache).

The router has no tokenizer, so a prefix is counted in chunks of characters of the request's
prompt text (`prompt_text`: the model name, then the messages, input or prompt as JSON, which grows
at its end from one turn of a conversation to the next): chunk k's key is a hash of chunk k and the
key of chunk k-1, so one key stands for the whole prefix up to it. The index keeps the
`max_entries` most recently used keys (least recently used dropped first), each with the replicas
that hold it, most recent last; a replica taken out of service is forgotten everywhere.

The replicas correct it: each answer's usage says how many prompt tokens the replica found in its
prefix cache (`prompt_tokens_details.cached_tokens`, or the Responses and Messages APIs' spellings,
`reported_hit`; a stream's last usage event, `StreamUsage`). A replica that reports well
under half the share of the prompt the index expected it to hold has lost what it was sent
(evicted under memory pressure, put to sleep, restarted): the router forgets it everywhere, and only
what that request has just put there is recorded again (replica_router.py).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from tessera.config.limits import MAX_STREAM_EVENT_BYTES


def prompt_text(body: dict) -> str:
    """The part of a request body a replica's prefix cache holds, as text (the model first)."""
    parts = [str(body.get("model", ""))]
    for key in ("system", "instructions", "messages", "input", "prompt"):
        if key in body:
            parts.append(json.dumps(body[key], ensure_ascii=False))
    return "\n".join(parts)


def reported_hit(content: bytes) -> tuple[int, int] | None:
    """(prompt tokens, of which found in the prefix cache) from an answer's usage, in any of the APIs'
    spellings: chat and completions (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), the
    Responses API (`input_tokens`, `input_tokens_details.cached_tokens`; streamed, in the `response` of
    its last event), Anthropic's Messages API (`cache_read_input_tokens` apart from `input_tokens`);
    None when the answer does not say (not JSON, or a server that does not report cached tokens)."""
    try:
        body = json.loads(content)
        usage = body.get("usage") or (body.get("response") or {}).get("usage") or {}
        if "prompt_tokens" in usage:
            prompt, cached = usage.get("prompt_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        elif "cache_read_input_tokens" in usage:
            computed, cached = usage.get("input_tokens"), usage.get("cache_read_input_tokens")
            prompt = computed + cached if _count(computed) and _count(cached) else None
        else:
            prompt, cached = usage.get("input_tokens"), (usage.get("input_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError, TypeError):
        return None
    return (prompt, cached) if _count(prompt) and _count(cached) and prompt > 0 else None


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


_DATA = (b"data: {", b"data:{")  # a server-sent event's line of JSON data


class StreamUsage:
    """`reported_hit` of the last server-sent event of a stream that carries a usage, read as the stream
    passes (`feed` each chunk, then `finish`): only the line in progress is held, and only while it
    can be an event's JSON data (`data: {...`) of at most `max_line_bytes`; a longer one is dropped
    unread and forgets the hit read before it (it may have been the last). However long an event is
    (a Responses stream's last one repeats the whole answer), its usage is found."""

    def __init__(self, max_line_bytes: int = MAX_STREAM_EVENT_BYTES):
        self.max_line_bytes = max_line_bytes
        self.line = bytearray()
        self.dropping = False  # the rest of the line in progress is not read
        self.hit: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if not self.dropping:
                self.line += chunk[start:] if end < 0 else chunk[start:end]
                head = bytes(self.line[:len(_DATA[0])])
                too_long = len(self.line) > self.max_line_bytes
                if too_long or not any(p.startswith(head) or head.startswith(p) for p in _DATA):
                    self.hit = None if too_long else self.hit  # a dropped event may have been the last usage
                    self.line.clear()
                    self.dropping = True
            if end < 0:
                return
            self._line_ended()
            start = end + 1

    def finish(self) -> tuple[int, int] | None:
        """The hit, once the stream has ended (a last line without its newline read too)."""
        self._line_ended()
        return self.hit

    def _line_ended(self) -> None:
        line = bytes(self.line).rstrip(b"\r")
        if not self.dropping and line.startswith(_DATA) and b'"usage"' in line:
            self.hit = reported_hit(line[len(b"data:"):])
        self.line.clear()
        self.dropping = False


class PrefixIndex:
    def __init__(self, chunk_chars: int = 64, max_entries: int = 100_000):
        self.chunk_chars, self.max_entries = chunk_chars, max_entries
        self.holders: OrderedDict[bytes, list[str]] = OrderedDict()
        self.queried_chunks = 0
        self.matched_chunks = 0

    def keys(self, text: str) -> list[bytes]:
        """The key of each whole chunk of `text`, in order (a partial last chunk has none)."""
        out, parent = [], b""
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            parent = hashlib.blake2b(parent + text[start:start + self.chunk_chars].encode(), digest_size=16).digest()
            out.append(parent)
        return out

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """Replica -> how many leading chunks of `keys` it was sent."""
        found: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, key in enumerate(keys, 1):
            holders = self.holders.get(key)
            alive = set(holders or ()) if alive is None else alive & set(holders or ())
            if not alive:
                break
            for replica in alive:
                found[replica] = depth
        return found

    def record(self, keys: list[bytes], replica: str, matched: int, count: bool = True) -> None:
        """`replica` was sent the prefix `keys` (`matched` of them were known to be there; `count`:
        in the hit rate, once per request)."""
        if count:
            self.queried_chunks += len(keys)
            self.matched_chunks += matched
        for key in keys:
            holders = self.holders.pop(key, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            self.holders[key] = holders
        while len(self.holders) > self.max_entries:
            self.holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key in list(self.holders):
            holders = self.holders[key]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self.holders[key]

    @property
    def hit_rate(self) -> float:
        return self.matched_chunks / self.queried_chunks if self.queried_chunks else 0.0
