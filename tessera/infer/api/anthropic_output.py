"""What `POST /v1/messages` answers, in Anthropic's shapes: the message object, its stream of events and
errors. The request side is anthropic_messages.py.

A message's `content` is a list of blocks: a `thinking` block (the reasoning the `--reasoning-parser`
read, with a `signature` that is "": Tessera signs nothing), a `text` block, then a `tool_use` block
(`id`, `name`, `input`: the arguments object) for each call; a block is there only when it has something
to hold. `stop_reason` is `tool_use` (the model stopped after calling), `max_tokens` (it ran out of
tokens, `max_tokens` or the context), `stop_sequence` (with `stop_sequence` the string of
`stop_sequences` that ended it) or `end_turn`. `usage` counts `input_tokens` (the prompt tokens
computed), `cache_read_input_tokens` (those the prefix cache held: the prompt is their sum),
`output_tokens`, and, where a reasoning parser is on, `output_tokens_details.thinking_tokens` (the
`<think>` block's).

Streamed, as server-sent events named by their `type`: `message_start` (the message with no content
and usage so far), for each block `content_block_start`, its `content_block_delta`s (`thinking_delta`,
`text_delta`, or `input_json_delta` whose `partial_json` fragments put together are the call's input
as JSON text) and `content_block_stop`, then `message_delta` (`stop_reason`, `stop_sequence`, the
whole usage: `message_start`'s counts the whole prompt as `input_tokens`, the cache not being read yet)
and `message_stop`; a failure after the stream started is an `error` event. The deltas are the agent
turn's (tessera/infer/agents/turn_output.py), so the streamed blocks hold what the whole message does;
text the model writes after its calls (rare: the turn reads it as content) comes, streamed, in a
second text block after them, whole, in the one text block before them.

Errors are `{"type": "error", "error": {"type": ..., "message": ...}}` with the HTTP status's type
(`invalid_request_error`, `authentication_error`, `not_found_error`, `request_too_large`,
`api_error`, ...), and the top-level request field at fault as `param` where one is (an addition of
Tessera's: the Anthropic clients ignore it).
"""

from __future__ import annotations

import json
from typing import Any

from tessera.infer.agents.tool_calls import ToolCallDelta
from tessera.infer.agents.turn_output import TurnDelta, TurnOutput

MESSAGES_PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": message}
    if param is not None:
        error["param"] = param
    return {"type": "error", "error": error}


def stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str, str | None]:
    """`(stop_reason, stop_sequence)` of a turn that ended with `finish_reason` (turn_output.py), the
    engine having cut its text at `stop_string` (None: it did not)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, thinking_tokens: int | None,
          cached_tokens: int = 0) -> dict[str, Any]:
    """`usage`; `thinking_tokens` None where no reasoning parser reads the output. As Anthropic counts
    them, `input_tokens` are the prompt tokens computed, apart from `cache_read_input_tokens` (found in
    the prefix cache); no request writes the cache on purpose, so `cache_creation_input_tokens` is 0."""
    use: dict[str, Any] = {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                           "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
    if thinking_tokens is not None:
        use["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return use


def _shell(message_id: str, model: str, content: list, stop: tuple[str | None, str | None],
           use: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}


def message_object(message_id: str, model: str, out: TurnOutput, stop: tuple[str, str | None],
                   use: dict[str, Any]) -> dict[str, Any]:
    """The whole message of a finished turn; `stop`: `stop_reason(...)`."""
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        content.append({"type": "text", "text": out.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                for c in out.tool_calls]
    return _shell(message_id, model, content, stop, use)


def sse(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class MessageEvents:
    """The events of one streamed message: `start()`, `step(delta)` for each of the turn's deltas,
    `end(stop, usage)`; each returns the events (dicts) to send, in order."""

    def __init__(self, message_id: str, model: str, input_tokens: int):
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self._count = 0  # blocks started
        self._open: tuple[str, int | None] | None = None  # the open block's kind (and call index)

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": _shell(self.message_id, self.model, [], (None, None),
                                                              usage(self.input_tokens, 0, None))}]

    def step(self, delta: TurnDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._into(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._into(("text", None), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def end(self, stop: tuple[str, str | None], use: dict[str, Any]) -> list[dict[str, Any]]:
        return self._close() + [{"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                 "usage": use}, {"type": "message_stop"}]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None:
            events += self._into(("tool_use", call.index), {"type": "tool_use", "id": call.id, "name": call.name,
                                                            "input": {}})
        if call.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def _into(self, kind: tuple[str, int | None], block: dict[str, Any]) -> list[dict[str, Any]]:
        """Into a block of `kind`: the open one if it is that, else the open one closed and a new one started."""
        if self._open == kind:
            return []
        events = self._close()
        self._open = kind
        self._count += 1
        return events + [{"type": "content_block_start", "index": self._count - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._count - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._count - 1}]
