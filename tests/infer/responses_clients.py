"""Responses API answers read through the official `openai` client: a streamed response checked event
by event (sequence numbers in order, each item announced, filled by its deltas and ended, the deltas
concatenating to the item's text), and a response's shape with its random ids and times left out,
so that a streamed answer and a whole one can be compared."""

from __future__ import annotations

from typing import Any

import openai

FLAT_WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                "strict": False}
# what differs between two equal requests: ids, times, and what the prefix cache held of the prompt
_RANDOM = {"id", "call_id", "item_id", "created_at", "completed_at", "previous_response_id", "input_tokens_details"}
_ENDS = ("response.completed", "response.incomplete")


def shape(obj: Any) -> Any:
    """A response (or item) as plain JSON without its ids, times and cached prompt tokens."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items() if k not in _RANDOM}
    if isinstance(obj, list):
        return [shape(v) for v in obj]
    return obj


def calls(response) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]


def reasoning(response) -> str:
    return "".join(c.text for o in response.output if o.type == "reasoning" for c in o.content or [])


def streamed(c: openai.OpenAI, **request):
    """The final response of a streamed request, after checking its events."""
    events = list(c.responses.create(stream=True, **request))
    check_events(events)
    return events[-1].response


def check_events(events: list) -> None:
    """The Responses stream's rules, and that the events rebuild the final response's output."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in _ENDS and all(e.type not in _ENDS for e in events[:-1])
    final = events[-1].response
    assert {e.response.id for e in (events[0], events[1], events[-1])} == {final.id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    built: list[dict] = []  # each item as its events build it
    open_: int | None = None
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_ is None and e.output_index == len(built) and e.item.status == "in_progress", e
            open_ = e.output_index
            built.append({"type": e.item.type, "id": e.item.id, "text": "", "parts": 0,
                          "arguments": getattr(e.item, "arguments", "")})
            continue
        assert e.output_index == open_, e  # every event belongs to the one open item
        item = built[open_]
        if e.type == "response.output_item.done":
            assert e.item.id == item["id"] and e.item == final.output[open_]
            assert item["parts"] in (0, 2), item  # a text item's part was added and done
            open_ = None
        elif e.type == "response.content_part.added":
            assert (item["parts"], e.part.text, e.content_index) == (0, "", 0)
            item["parts"] = 1
        elif e.type == "response.content_part.done":
            assert item["parts"] == 1 and e.part.text == item["text"]
            item["parts"] = 2
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert e.item_id == item["id"] and e.type.split(".")[1] == _text_kind(item["type"])
            item["text"] += e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == item["text"]
        elif e.type == "response.function_call_arguments.delta":
            item["arguments"] += e.delta
        else:
            assert e.type == "response.function_call_arguments.done" and e.arguments == item["arguments"], e
    assert open_ is None and len(built) == len(final.output)
    for item, out in zip(built, final.output):
        if out.type == "function_call":
            assert item["arguments"] == out.arguments
        else:
            assert [item["text"]] == [c.text for c in out.content]


def _text_kind(item_type: str) -> str:
    return {"message": "output_text", "reasoning": "reasoning_text"}[item_type]
