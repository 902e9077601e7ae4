"""Constrained tool calls and refused tool requests on /v1/chat/completions, through the official `openai`
client against a real server on 127.0.0.1 serving a random model (which writes no call of its own):
under `tool_choice: required` (parallel or not), a named function, and a `strict` tool under `auto`,
every sampled choice is calls of offered functions whose arguments validate against their schemas
(nested objects, enums, arrays, bounded numbers), streamed as whole; the same request without `strict`
writes a malformed call, which comes back as content, never a 500; with no --tool-call-parser the
constrained calls are hermes'. Bad requests (a tool choice naming no offered tool, an invalid schema,
10,000 tools, a 1 MiB description, a tool message answering no call, ...) are a 400 naming the field,
refused before the engine, while a request already in the batch completes as alone; `tessera serve`
refuses --enable-auto-tool-choice without a parser before it loads the model."""

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
from tests.infer.chat_clients import client, streamed, whole
from tests.infer.running_server import RunningServer, serve_main
from tests.infer.test_server import _hold_engine, _wait_for_inbox

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "owner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 3}},
              "required": ["ok", "tags"], "additionalProperties": False}},
    "required": ["id", "owner"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                          "days": {"type": "integer", "enum": [1, 3, 7]}},
         "required": ["unit", "days"], "additionalProperties": False}
ARRAY = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "minItems": 1, "maxItems": 4}},
         "required": ["cities"], "additionalProperties": False}
BOUNDED = {"type": "object", "properties": {  # multiples of binary fractions: jsonschema checks them exactly
    "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.25},
    "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.5},
    "n": {"type": "integer", "minimum": 10, "maximum": 99}},
    "required": ["lat", "lon", "n"], "additionalProperties": False}
SCHEMAS = {"nested": NESTED, "enums": ENUMS, "array": ARRAY, "bounded": BOUNDED}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"takes {name}", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
ASK = [{"role": "user", "content": "Use a tool."}]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-agent")
    return path, write_agent_model(path, QWEN25_TEMPLATE)


def _serve(path, options: AgentOptions) -> RunningServer:
    return RunningServer(LLMEngine.from_dir(path, EngineConfig(block_size=16, max_num_seqs=16)), name="agent",
                         agents=options)


@pytest.fixture(scope="module")
def served(random_model):
    with _serve(random_model[0], AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)) as s:
        yield s


def _valid(name: str, arguments: str, offered: set[str]) -> bool:
    if name not in offered:
        return False
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _bias(random_model) -> dict:
    """A bias that makes the model open a call at once (`<tool_call>`), as a model that means to call does."""
    return {"logit_bias": {str(random_model[1]["<tool_call>"]): 100}}


CASES = {  # request fields -> the tools a call may name, and whether one call only
    "required": ({"tool_choice": "required"}, set(SCHEMAS), False),
    "required-one": ({"tool_choice": "required", "parallel_tool_calls": False}, set(SCHEMAS), True),
    **{f"named-{n}": ({"tool_choice": {"type": "function", "function": {"name": n}}}, {n}, True) for n in SCHEMAS},
    "strict-auto": ({"tools": STRICT, "parallel_tool_calls": False}, set(SCHEMAS), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_calls_of_a_random_model_always_validate(served, random_model, case):
    fields, offered, single = CASES[case]
    request = {"model": "agent", "messages": ASK, "tools": TOOLS, "temperature": 1.0, "max_tokens": 400,
               **(_bias(random_model) if case == "strict-auto" else {}), **fields}
    r = client(served.url).chat.completions.create(n=6, seed=7, **request)
    for choice in r.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls and (len(calls) == 1 or not single), choice
        assert all(_valid(t.function.name, t.function.arguments, offered) for t in calls), calls
    one = whole(client(served.url), seed=3, **request)
    assert one.calls and all(_valid(n, a, offered) for n, a in one.calls)
    assert streamed(client(served.url), seed=3, **request).calls == one.calls


def test_an_unconstrained_malformed_call_is_content_not_an_error(served, random_model):
    """The same biased request as strict-auto's, the tools not strict: the model opens calls it
    never writes, and the text comes back as content."""
    request = {"model": "agent", "messages": ASK, "tools": TOOLS, "temperature": 1.0, "max_tokens": 40,
               "parallel_tool_calls": False, **_bias(random_model)}
    for read in (whole, streamed):
        answer = read(client(served.url), seed=3, **request)
        assert answer.calls == [] and answer.content.startswith("<tool_call>") and answer.finish_reason == "length"


def test_constrained_calls_need_no_parser_and_auto_needs_the_option(random_model):
    """Without --tool-call-parser, required calls are written (and read) as hermes'; `auto`, the
    default where tools are offered, is refused naming tool_choice, as vLLM does."""
    with _serve(random_model[0], AgentOptions()) as s:
        answer = whole(client(s.url), model="agent", messages=ASK, tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=400)
        assert len(answer.calls) == 1 and _valid(*answer.calls[0], set(SCHEMAS))
        for fields in ({}, {"tool_choice": "auto"}):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=HANG_S,
                           json={"model": "agent", "messages": ASK, "tools": TOOLS, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def _tool(name: str = "f", **function) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}, **function}}


CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
BAD = {  # request fields -> the param of the 400 and words of its message
    "named-unknown": ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                      "tool_choice", "must name an offered tool"),
    "invalid-schema": ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "nonsense"}}})]},
                       "tools", "tools[0].parameters="),
    "not-an-object": ({"tools": [_tool(parameters={"type": "array"})]}, "tools", "must describe the arguments"),
    "10000-tools": ({"tools": [_tool(f"t{i}") for i in range(10_000)]}, "tools", "len(tools)=10000 is invalid"),
    "1MiB-description": ({"tools": [_tool(description="d" * 2**20)]}, "tools", "tools[0].description="),
    "duplicate-names": ({"tools": [_tool(), _tool()]}, "tools", "unique"),
    "not-a-function": ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
    "required-without-tools": ({"tool_choice": "required"}, "tool_choice", "none are offered"),
    "tool-answers-no-call": ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
                             "messages", "messages[1].tool_call_id='call_9' is invalid"),
    "tool-answers-a-later-call": ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"},
                                                CALLED]}, "messages", "messages[1].tool_call_id"),
    "arguments-not-json": ({"messages": [*ASK, {**CALLED, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
        "messages", "arguments must be the JSON text of an object"),
    "reserved-template-variable": ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set"),
    "with-response-format": ({"tools": [_tool()], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format", "must be unset"),
}


def test_bad_tool_requests_are_refused_by_field_while_the_batch_goes_on(served):
    """Each bad request is answered (a 400 naming its field) while the engine is held with a request
    in it, so before the engine sees it; released, that request completes as it does alone."""
    free = {"model": "agent", "messages": ASK, "max_tokens": 16, "temperature": 0, "stream": False}
    alone = httpx.post(served.url + "/v1/chat/completions", json=free, timeout=HANG_S).json()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(served.url + "/v1/chat/completions",
                                                                        json=free, timeout=HANG_S)))
    gate = _hold_engine(served)
    try:
        worker.start()
        _wait_for_inbox(served, 1)
        for case, (fields, param, words) in BAD.items():
            r = httpx.post(served.url + "/v1/chat/completions", timeout=HANG_S,
                           json={"model": "agent", "messages": ASK, "max_tokens": 4, **fields})
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (400, param), (case, r.text[:500])
            assert words in error["message"] and len(error["message"]) < 600, (case, error["message"])
    finally:
        gate.set()
        worker.join(HANG_S)
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["message"] == alone["choices"][0]["message"]


def test_the_openai_client_raises_the_refusal(served):
    with pytest.raises(openai.BadRequestError, match="must name an offered tool"):
        client(served.url).chat.completions.create(model="agent", messages=ASK, tools=TOOLS,
                                                   tool_choice={"type": "function", "function": {"name": "nope"}})


def test_serve_refuses_auto_tool_choice_without_a_parser_before_loading(tmp_path, capsys):
    assert serve_main([str(tmp_path / "no-such-model"), "--port", "0", "--device", "cpu",
                       "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
