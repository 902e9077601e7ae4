"""A Responses API answer built from one agent turn's output as the engine produces it: the stream's
events, each with its `sequence_number`, and the response object, which is the same whether the
client streamed or not (the server runs this builder over the engine's outputs either way and, not
streaming, drops the events).

Output items, in the order the text holds them, each closed before the next opens:

- `reasoning` (`rs_...`): the `<think>` block, as `content: [{"type": "reasoning_text", "text"}]`
  with an empty `summary`; streamed as `response.reasoning_text.delta` / `.done`;
- `message` (`msg_...`, role `assistant`): the text outside the reasoning and the calls, as
  `content: [{"type": "output_text", "text", "annotations": [], "logprobs": []}]`; streamed as
  `response.output_text.delta` / `.done` (text after a call opens another message);
- `function_call` (`fc_...`): `call_id` (the id a `function_call_output` answers), `name` and
  `arguments` (JSON text of an object); streamed as `response.function_call_arguments.delta` / `.done`.

Each item is announced by `response.output_item.added` (status `in_progress`) and ended by
`response.output_item.done` (the whole item); text items add `response.content_part.added` /
`.done` around their deltas. The stream opens with `response.created` and `response.in_progress`
and ends with `response.completed` (the model stopped, or called tools), `response.incomplete`
(`max_output_tokens` reached: `incomplete_details.reason: "max_output_tokens"`, the cut item
`incomplete`) or `response.failed` (`error`). An output with no item at all is one empty message.
`usage`: `input_tokens` (all of the prompt), `input_tokens_details.cached_tokens` (those found in the
prefix cache), `output_tokens`, `output_tokens_details.reasoning_tokens`, `total_tokens`.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any

from tessera.infer.agents.tool_calls import ToolCallDelta
from tessera.infer.agents.turn import PastCall, TurnMessage
from tessera.infer.agents.turn_output import EngineOutput, TurnDecoder

_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}
_PART = {"message": "output_text", "reasoning": "reasoning_text"}
_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
# a turn's finish reason -> the response's status
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "cancelled",
          "error": "failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, model: str, echo: dict[str, Any]) -> dict[str, Any]:
    """A response not yet started: its id, model and the request fields it repeats (`echo`)."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "completed_at": None, "error": None, "incomplete_details": None, "model": model, "output": [],
            "usage": None, **echo}


def _part(kind: str, text: str) -> dict[str, Any]:
    part = {"type": _PART[kind], "text": text}
    return {**part, "annotations": [], "logprobs": []} if kind == "message" else part


class ResponseBuilder:
    """The response `response` (response_object's) filled from one output: `start()` and then
    `step(out)` for each engine output return the events to send; `response` is the object."""

    def __init__(self, response: dict[str, Any], decoder: TurnDecoder):
        self.response, self.decoder = response, decoder
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the item taking deltas
        self.texts: dict[str, str] = {}  # item id -> its text so far (message and reasoning items)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return self._event(kind, response=copy.deepcopy(self.response))

    def start(self) -> list[dict[str, Any]]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def step(self, out: EngineOutput) -> list[dict[str, Any]]:
        """The events of one engine output (the last ones finish the response)."""
        delta = self.decoder.step(out)
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        if out.finished:
            events += self._finish(out, delta.finish_reason or out.finish_reason or "stop")
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        output = self.response["output"]
        output.append(item)
        self.open = item
        events = [self._event("response.output_item.added", output_index=len(output) - 1, item=copy.deepcopy(item))]
        if item["type"] in _PART:
            self.texts[item["id"]] = ""
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(output) - 1, content_index=0, part=_part(item["type"], "")))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            item = {"id": new_id(_PREFIX[kind]), "type": kind, "status": "in_progress", "content": []}
            item.update({"role": "assistant"} if kind == "message" else {"summary": []})
            events += self._add(item)
        item_id = self.open["id"]
        self.texts[item_id] += text
        fields = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(_DELTA[kind], item_id=item_id, output_index=len(self.response["output"]) - 1,
                                     content_index=0, delta=text, **fields)]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None:
            events += self._close("completed")
            events += self._add({"id": new_id(_PREFIX["function_call"]), "type": "function_call", "status":
                                 "in_progress", "call_id": call.id, "name": call.name, "arguments": ""})
        if call.arguments:
            self.open["arguments"] += call.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.response["output"]) - 1, delta=call.arguments))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """End the open item (if any) with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, kind = len(self.response["output"]) - 1, item["type"]
        item["status"] = status
        events = []
        if kind == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
        else:
            text = self.texts.pop(item["id"])
            item["content"] = [_part(kind, text)]
            done = {"logprobs": []} if kind == "message" else {}
            events += [self._event(_DONE[kind], item_id=item["id"], output_index=index, content_index=0, text=text,
                                   **done),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_part(kind, text))]
        return events + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _finish(self, out: EngineOutput, reason: str) -> list[dict[str, Any]]:
        status = STATUS.get(reason, "completed")
        events: list[dict[str, Any]] = []
        if not self.response["output"] and status in ("completed", "incomplete"):
            events += self._empty_message()
        cut = status == "incomplete" and self.open is not None and self.open["type"] != "function_call"
        events += self._close("incomplete" if cut else "completed")
        response = self.response
        response["status"] = status
        if status == "completed":
            response["completed_at"] = int(time.time())
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            response["error"] = {"code": "server_error", "message": f"generation failed: {out.error}"}
        output_tokens = len(out.token_ids)
        response["usage"] = {"input_tokens": out.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": out.cached_tokens},
                             "output_tokens": output_tokens,
                             "output_tokens_details": {"reasoning_tokens": self.decoder.reasoning_tokens},
                             "total_tokens": out.prompt_tokens + output_tokens}
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return events + [self._lifecycle(kind)]

    def _empty_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id(_PREFIX["message"]), "type": "message", "status": "in_progress", "content": [],
                "role": "assistant"}
        return self._add(item)

    def assistant_message(self) -> TurnMessage:
        """The output as the conversation's next assistant message (what a continuation sees)."""
        text, calls, reasoning = [], [], []
        for item in self.response["output"]:
            if item["type"] == "function_call":
                calls.append(PastCall(item["call_id"], item["name"], json.loads(item["arguments"])))
            else:
                (text if item["type"] == "message" else reasoning).append(item["content"][0]["text"])
        content = "".join(text) if text or not calls else None
        return TurnMessage("assistant", content, tuple(calls), reasoning="".join(reasoning) or None)
