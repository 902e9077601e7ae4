"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) through the official `openai` client
against a real server on 127.0.0.1, served from the scripted agent of the chat tool tests
(agent_scripts.py, the session's `scripted_agent`: a tiny model that really calls its tools, reasons
and answers): every `tool_choice`, streamed and not, the stream's events in order with deltas that
make up exactly the whole answer; a two-turn tool loop continued by `previous_response_id` and by
sending the items back; a stored response read back by id, and `store: false` keeping nothing; with
`--reasoning-parser qwen3` the `<think>` block is a `reasoning` output item, counted in usage, apart
from the call after it; a request that repeats a long prefix reports the prompt tokens the prefix cache
held (`usage.input_tokens_details.cached_tokens`), as many as the server's own cache counted."""

from __future__ import annotations

import json

import openai
import pytest

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.agents.options import AgentOptions
from tests.infer.agent_models import QWEN3_TEMPLATE, qwen_tokenizer, with_template
from tests.infer.agent_scripts import ANSWER, ASK, ASK_ONE, GREETING, HELLO, REASONING, RESULTS, call_text
from tests.infer.chat_clients import client
from tests.infer.responses_clients import FLAT_WEATHER, calls, reasoning, shape, streamed
from tests.infer.running_server import RunningServer, prefix_hit_tokens

pytest.importorskip("llguidance")

PARIS, ROME = ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')
TOOLS = [FLAT_WEATHER]


def _serve(path, options: AgentOptions):
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=16, max_num_seqs=8))
    return RunningServer(engine, name="agent", agents=options)


@pytest.fixture(scope="module")
def agent(scripted_agent):
    with _serve(scripted_agent, AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)) as s:
        yield client(s.url)


@pytest.fixture(scope="module")
def thinker(scripted_agent, tmp_path_factory):
    path = with_template(scripted_agent, tmp_path_factory.mktemp("qwen3") / "agent", QWEN3_TEMPLATE)
    options = AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    with _serve(path, options) as s:
        yield client(s.url)


def _results(response) -> list[dict]:
    """A `function_call_output` item answering each call of `response`."""
    return [{"type": "function_call_output", "call_id": o.call_id, "output": RESULTS[json.loads(o.arguments)["city"]]}
            for o in response.output if o.type == "function_call"]


def test_a_tool_loop_continues_by_previous_response_id_and_by_items(agent):
    first = agent.responses.create(model="agent", input=ASK[0]["content"], tools=TOOLS, temperature=0)
    assert (first.status, calls(first), first.output_text) == ("completed", [PARIS, ROME], "")
    ids = [o.call_id for o in first.output]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(o.id.startswith("fc_") and o.status == "completed" for o in first.output)
    chained = agent.responses.create(model="agent", previous_response_id=first.id, input=_results(first), tools=TOOLS,
                                     temperature=0)
    assert (chained.output_text, calls(chained), chained.previous_response_id) == (ANSWER, [], first.id)
    [message] = chained.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed", "msg_")
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]},
             *[o.model_dump(exclude_none=True) for o in first.output], *_results(first)]
    explicit = agent.responses.create(model="agent", input=items, tools=TOOLS, temperature=0)
    assert shape(explicit.output) == shape(chained.output)
    assert explicit.usage.input_tokens == chained.usage.input_tokens  # the same conversation, the same prompt


def test_a_stored_response_is_read_back_and_store_false_keeps_nothing(agent):
    kept = agent.responses.create(model="agent", input=HELLO[0]["content"], tools=TOOLS, temperature=0)
    assert kept.output_text == GREETING and kept.store is True
    assert agent.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    gone = agent.responses.create(model="agent", input=HELLO[0]["content"], tools=TOOLS, temperature=0, store=False)
    assert gone.output_text == GREETING and gone.store is False
    with pytest.raises(openai.NotFoundError, match="is not stored"):
        agent.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id") as refused:
        agent.responses.create(model="agent", previous_response_id=gone.id, input="And now?", tools=TOOLS)
    assert refused.value.body["param"] == "previous_response_id"


NAMED = {"type": "function", "name": "get_weather"}
MODES = {  # request fields -> the calls, and the text, the scripted model's turn comes out as
    "auto": ({}, [PARIS, ROME], ""),
    "required": ({"tool_choice": "required"}, [PARIS, ROME], ""),
    "required-one": ({"tool_choice": "required", "parallel_tool_calls": False}, [PARIS], ""),
    "named": ({"tool_choice": NAMED}, [PARIS], ""),
    "none": ({"tool_choice": "none"}, [], call_text(["Paris", "Rome"])),  # calls not read: the text itself
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_tool_choice_streams_what_it_answers_whole(agent, mode):
    fields, expected, text = MODES[mode]
    request = dict(model="agent", input=ASK[0]["content"], tools=TOOLS, temperature=0, **fields)
    answer = agent.responses.create(**request)
    assert (calls(answer), answer.output_text, answer.status) == (expected, text, "completed")
    assert answer.tool_choice == fields.get("tool_choice", "auto") or answer.tool_choice.name == "get_weather"
    stream = streamed(agent, **request)  # its events checked one by one
    assert shape(stream) == shape(answer)
    assert stream.usage.output_tokens == answer.usage.output_tokens > 0


def test_the_stream_helper_ends_with_the_answer(agent):
    request = dict(model="agent", input=HELLO[0]["content"], tools=TOOLS, temperature=0)
    deltas = []
    with agent.responses.stream(**request) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == GREETING and len(deltas) > 1
    assert shape(final) == shape(agent.responses.create(**request))


def test_reasoning_is_an_output_item_apart_from_the_call_and_counted(thinker):
    request = dict(model="agent", input=ASK_ONE[0]["content"], tools=TOOLS, temperature=0)
    answer = thinker.responses.create(**request)
    assert [o.type for o in answer.output] == ["reasoning", "function_call"]
    assert (reasoning(answer), calls(answer), answer.output_text) == (REASONING, [PARIS], "")
    assert answer.output[0].summary == [] and answer.output[0].id.startswith("rs_")
    thought = len(qwen_tokenizer().encode(REASONING + "\n</think>", add_special_tokens=False).ids)
    assert answer.usage.output_tokens_details.reasoning_tokens == thought < answer.usage.output_tokens
    stream = streamed(thinker, **request)
    assert shape(stream) == shape(answer)


# unlike any other test's prompt, so that the first request finds nothing of it cached
LONG_SYSTEM = ("Quokka archivists of the northern fjords catalogue every barnacle, tide table and lantern "
               "they find, in triplicate, before the evening ferry leaves the harbour for the islands.")
BLOCK = 16  # the block size _serve gives the engine


def test_a_repeated_long_prefix_reports_the_cached_tokens(agent):
    url = str(agent.base_url).removesuffix("/").removesuffix("/v1")
    request = dict(model="agent", instructions=LONG_SYSTEM, input=HELLO[0]["content"], temperature=0,
                   max_output_tokens=4)
    first = agent.responses.create(**request)
    assert first.usage.input_tokens_details.cached_tokens == 0
    hits = prefix_hit_tokens(url)
    again = agent.responses.create(**request)
    prompt = again.usage.input_tokens
    assert prompt == first.usage.input_tokens > 2 * BLOCK
    # every full block but the one holding the last prompt token, which runs again to give the next token
    assert again.usage.input_tokens_details.cached_tokens == (prompt - 1) // BLOCK * BLOCK
    assert prefix_hit_tokens(url) - hits == again.usage.input_tokens_details.cached_tokens
    other = agent.responses.create(**(request | {"input": ASK[0]["content"]}))  # the same instructions only
    cached = other.usage.input_tokens_details.cached_tokens
    assert 0 < cached < other.usage.input_tokens and cached % BLOCK == 0
    stream = streamed(agent, **request)
    assert stream.usage.input_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens
