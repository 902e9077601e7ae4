"""The Responses API's stored responses: what `GET /v1/responses/{id}` answers and what a later
request's `previous_response_id` continues, kept in memory and bounded.

Each entry is a finished response (`store` not false): the response object as the client got it,
and the conversation it ends (the turn's messages less its `instructions`, which a continuation does
not inherit, then its output as one assistant message), which a continuation extends with its own
input. The conversation is a tuple of immutable messages, so a continuation shares its predecessor's
messages instead of copying them.

Bounded twice: at most `max_entries` responses and `max_chars` characters of them (each entry
counted as its response's JSON text and its conversation's text, shared messages counted in every
entry that holds them, so the bound holds however the entries are related); the least recently
stored or used response goes first. A conversation only reaches the store after it fit the model's
context, so one entry never exceeds what one request could send. Nothing persists across restarts.
Thread-safe: requests are prepared in worker threads and finished on the event loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tessera.infer.agents.turn import TurnMessage

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_CHARS = 2**26  # 64M characters (a few hundred full 32k-token conversations)


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its object (JSON-ready) and the conversation it ends."""

    response: dict
    conversation: tuple[TurnMessage, ...]

    @property
    def chars(self) -> int:
        text = sum(len(m.content or "") + len(m.reasoning or "") + sum(len(c.name) + len(json.dumps(c.arguments))
                                                                       for c in m.tool_calls)
                   for m in self.conversation)
        return text + len(json.dumps(self.response))


class ResponseStore:
    """Responses by id, least recently used evicted first past `max_entries` or `max_chars`."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_chars: int = DEFAULT_MAX_CHARS):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Keep `entry` under its response's id; an entry larger than the whole bound is not kept."""
        size = entry.chars
        with self._lock:
            self._drop(entry.response["id"])
            if size > self.max_chars:
                return
            self._entries[entry.response["id"]] = (entry, size)
            self._chars += size
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response `response_id` (None: never stored, or evicted), now the most recent."""
        with self._lock:
            found = self._entries.get(response_id)
            if found is None:
                return None
            self._entries.move_to_end(response_id)
            return found[0]

    def _drop(self, response_id: str) -> None:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self._chars -= found[1]
