"""The conversations the scripted agent of the tool-call tests learns (agent_models.write_scripted_agent),
and the requests that replay them through the official `openai` client.

A Qwen2.5-style turn that calls `get_weather` twice in parallel, the turn after both results that
answers from them, a turn that answers without calling; a Qwen3-style turn that reasons in the
`<think>` block its prompt opened and then calls, and one with `enable_thinking: false` that answers
at once. The prompts are transformers' renderings of the same messages the tests send, so the served
model meets exactly the text it learnt.
"""

from __future__ import annotations

import json

from tests.infer.agent_models import QWEN3_TEMPLATE, QWEN25_TEMPLATE, render

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER]
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
HELLO = [{"role": "user", "content": "Say hello."}]
ASK_ONE = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULTS = {"Paris": "18 C, sunny", "Rome": "21 C, clear"}
ANSWER = "Paris: 18 C, sunny. Rome: 21 C, clear."
GREETING = "Hello! How can I help?"
REASONING = "The user asks about Paris; get_weather answers that."


def call_text(cities: list[str]) -> str:
    """The calls as Qwen's templates write them (and the model learns to)."""
    return "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                     for c in cities)


def answered(calls: list[tuple[str, str]]) -> list[dict]:
    """ASK, the assistant's calls `(id, city)` as a client sends them back (arguments as JSON text),
    and a tool result for each."""
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for i, c in calls]}
    return ASK + [assistant] + [{"role": "tool", "tool_call_id": i, "content": RESULTS[c]} for i, c in calls]


def _as_template_sees(messages: list[dict]) -> list[dict]:
    """Arguments as objects, as the server hands them to the template (transformers' convention)."""
    out = []
    for m in messages:
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in m.get("tool_calls") or []]
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


def script() -> list[tuple[str, str]]:
    """(prompt, completion) pairs of both templates, each completion ending the turn."""
    end = "<|im_end|>"
    return [
        (render(QWEN25_TEMPLATE, ASK, TOOLS), call_text(["Paris", "Rome"]) + end),
        (render(QWEN25_TEMPLATE, _as_template_sees(answered([("call_1", "Paris"), ("call_2", "Rome")])), TOOLS),
         ANSWER + end),
        (render(QWEN25_TEMPLATE, HELLO, TOOLS), GREETING + end),
        (render(QWEN3_TEMPLATE, ASK_ONE, TOOLS), REASONING + "\n</think>\n\n" + call_text(["Paris"]) + end),
        (render(QWEN3_TEMPLATE, HELLO, TOOLS, enable_thinking=False), GREETING + end),
    ]
