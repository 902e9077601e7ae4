"""The official `openai` client against a test server, and a chat answer read the same way whether it
was streamed or not, so that the two can be compared."""

from __future__ import annotations

from dataclasses import dataclass

import openai

from tests.hang_guard import HANG_S


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=HANG_S)


@dataclass
class Answer:
    """One choice: its text, reasoning, calls `(name, arguments)` with their ids, the finish reason
    and the request's usage."""

    content: str
    reasoning: str
    calls: list[tuple[str, str]]
    ids: list[str]
    finish_reason: str
    usage: object = None


def _extra(obj, key: str):
    return (obj.model_extra or {}).get(key)


def whole(c: openai.OpenAI, **request) -> Answer:
    r = c.chat.completions.create(**request)
    [choice] = r.choices
    m = choice.message
    calls = m.tool_calls or []
    assert all(t.type == "function" for t in calls)
    return Answer(m.content or "", _extra(m, "reasoning_content") or "",
                  [(t.function.name, t.function.arguments) for t in calls], [t.id for t in calls],
                  choice.finish_reason, r.usage)


def streamed(c: openai.OpenAI, **request) -> Answer:
    """The streamed chunks put together, checking the shape of the call deltas on the way: a call's
    first delta carries its index, id, type and name, the later ones only argument fragments."""
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish, usage = None, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += _extra(d, "reasoning_content") or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.index == len(calls) and t.id and t.type == "function" and t.function.name, t
                    calls[t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.id is None and t.function.name is None, t
                calls[t.index][2] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return Answer(content, reasoning, [(n, a) for _, n, a in calls.values()], [i for i, _, _ in calls.values()],
                  finish, usage)
