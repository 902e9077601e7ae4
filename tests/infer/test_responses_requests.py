"""Responses API requests through the official `openai` client against a real server on 127.0.0.1 serving
a random model: a conversation sent as Responses input (instructions, items of every type, a stored
response continued) renders as the same conversation sent to /v1/chat/completions does, so both
answer the same greedy text; `max_output_tokens` ends a response `incomplete`; `text.format` and
`tool_choice: required` constrain the answer to its schema; bad requests (unknown item, part and
tool types, an unknown `previous_response_id`, a tool choice naming no offered tool, an output
answering no call, ...) are a 4xx naming the field, refused before the engine, while a request
already in the batch completes as alone."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.agents.options import AgentOptions
from tests.hang_guard import HANG_S
from tests.infer.agent_models import QWEN25_TEMPLATE, write_agent_model
from tests.infer.chat_clients import client
from tests.infer.responses_clients import FLAT_WEATHER, calls, shape, streamed
from tests.infer.running_server import RunningServer
from tests.infer.test_server import _hold_engine, _wait_for_inbox

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

CHAT_WEATHER = {"type": "function", "function": {k: FLAT_WEATHER[k] for k in ("name", "description", "parameters")}}
GREEDY = dict(model="agent", temperature=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-agent")
    write_agent_model(path, QWEN25_TEMPLATE)
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=16, max_num_seqs=8))
    options = AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)
    with RunningServer(engine, name="agent", agents=options) as s:
        yield s


def _chat_text(c: openai.OpenAI, messages: list[dict], **fields) -> str:
    return c.chat.completions.create(messages=messages, max_tokens=12, **GREEDY, **fields).choices[0].message.content


def test_instructions_and_items_render_as_the_chat_conversation(served):
    c = client(served.url)
    with_instructions = c.responses.create(input="Hi.", instructions="Be brief.", max_output_tokens=12, **GREEDY)
    assert with_instructions.output_text == _chat_text(c, [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi."}])
    assert with_instructions.output_text != c.responses.create(input="Hi.", max_output_tokens=12, **GREEDY).output_text
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "3 C, snow"},
             {"role": "user", "content": "Thanks."}]
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_7", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "3 C, snow"},
                {"role": "user", "content": "Thanks."}]
    answer = c.responses.create(input=items, tools=[FLAT_WEATHER], tool_choice="none", max_output_tokens=12, **GREEDY)
    assert answer.output_text == _chat_text(c, messages, tools=[CHAT_WEATHER], tool_choice="none")


def test_a_continuation_renders_the_stored_conversation_without_its_instructions(served):
    c = client(served.url)
    first = c.responses.create(input="Hi.", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    second = c.responses.create(input="More.", previous_response_id=first.id, max_output_tokens=12, **GREEDY)
    assert second.output_text == _chat_text(c, [{"role": "user", "content": "Hi."},
                                                {"role": "assistant", "content": first.output_text},
                                                {"role": "user", "content": "More."}])


def test_max_output_tokens_ends_the_response_incomplete(served):
    c = client(served.url)
    request = dict(input="Tell me a story.", max_output_tokens=3, **GREEDY)
    for answer in (c.responses.create(**request), streamed(c, **request)):
        assert (answer.status, answer.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert (answer.output[0].status, answer.usage.output_tokens, answer.max_output_tokens) == ("incomplete", 3, 3)
    assert shape(c.responses.retrieve(answer.id)) == shape(answer)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["n", "unit"], "additionalProperties": False}


def test_text_format_and_required_calls_follow_their_schemas(served):
    c = client(served.url)
    text = {"format": {"type": "json_schema", "name": "reading", "schema": SCHEMA, "strict": True}}
    answer = c.responses.create(input="A reading.", text=text, max_output_tokens=64, **GREEDY)
    jsonschema.validate(json.loads(answer.output_text), SCHEMA)
    tool = {"type": "function", "name": "read", "description": "a reading", "parameters": SCHEMA, "strict": True}
    for ask in ("Read.", "Read it now.", "Another one."):
        made = streamed(c, input=ask, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                        max_output_tokens=64, **GREEDY)
        [(name, arguments)] = calls(made)
        assert name == "read" and made.status == "completed"
        jsonschema.validate(json.loads(arguments), SCHEMA)


def _call(call_id: str = "call_1") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": '{"city": "Oslo"}'}


BAD = {  # request fields -> the status, the field named, words of the message
    "item type": ({"input": [{"role": "user", "content": "Hi."}, {"type": "web_search_call", "id": "ws_1"}]},
                  400, "input", "input[1].type='web_search_call' is invalid"),
    "part type": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                  400, "input", "input[0].content[0].type='input_image' is invalid"),
    "role": ({"input": [{"role": "tool", "content": "Hi."}]}, 400, "input", "input[0].role='tool' is invalid"),
    "no input": ({}, 400, "input", "input=None is invalid"),
    "output answering no call": ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
                                 400, "input", "input[0].call_id='call_9' is invalid"),
    "arguments": ({"input": [{**_call(), "arguments": "{not json"}]}, 400, "input", "input[0].arguments="),
    "previous_response_id": ({"input": "Hi.", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
                             "is not a stored response"),
    "named tool not offered": ({"input": "Hi.", "tools": [FLAT_WEATHER], "tool_choice": {"type": "function",
                                                                                         "name": "nope"}},
                               400, "tool_choice", "must name an offered tool"),
    "tool choice": ({"input": "Hi.", "tools": [FLAT_WEATHER], "tool_choice": "sometimes"}, 400, "tool_choice",
                    "tool_choice='sometimes' is invalid"),
    "chat-shaped tool": ({"input": "Hi.", "tools": [CHAT_WEATHER]}, 400, "tools", "tools are flat"),
    "hosted tool": ({"input": "Hi.", "tools": [{"type": "web_search"}]}, 400, "tools", "tools[0].type='web_search'"),
    "schema": ({"input": "Hi.", "tools": [{**FLAT_WEATHER, "parameters": {"type": "string"}}]}, 400, "tools",
               "'type': 'object'"),
    "max_output_tokens": ({"input": "Hi.", "max_output_tokens": 0}, 400, "max_output_tokens", "must be an integer"),
    "background": ({"input": "Hi.", "background": True}, 400, "background", "does not support it"),
    "temperature": ({"input": "Hi.", "temperature": "hot"}, 400, "temperature", "'temperature' must be"),
    "text format": ({"input": "Hi.", "text": {"format": {"type": "yaml"}}}, 400, "text", "text.format="),
}


def test_bad_requests_are_refused_by_field_while_the_batch_goes_on(served):
    """Each bad request is answered while the engine is held with a request in it, so before the
    engine sees it; released, that request completes as it does alone."""
    free = {"model": "agent", "input": "Hi.", "max_output_tokens": 16, "temperature": 0}
    alone = httpx.post(served.url + "/v1/responses", json=free, timeout=HANG_S).json()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(served.url + "/v1/responses", json=free,
                                                                        timeout=HANG_S)))
    gate = _hold_engine(served)
    try:
        worker.start()
        _wait_for_inbox(served, 1)
        for case, (fields, status, param, words) in BAD.items():
            r = httpx.post(served.url + "/v1/responses", json={"model": "agent", **fields}, timeout=HANG_S)
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (status, param), (case, r.text[:500])
            assert words in error["message"] and len(error["message"]) < 600, (case, error["message"])
    finally:
        gate.set()
        worker.join(HANG_S)
    assert result["r"].status_code == 200
    assert shape(result["r"].json()["output"]) == shape(alone["output"])


def test_an_unknown_response_id_is_a_404(served):
    with pytest.raises(openai.NotFoundError, match="resp_nope") as refused:
        client(served.url).responses.retrieve("resp_nope")
    assert refused.value.body["param"] == "response_id"
