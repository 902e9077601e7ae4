"""POST /v1/messages through the official `anthropic` client against a real server on 127.0.0.1, served
from the scripted agent of the chat tests (agent_scripts.py: a tiny model that really calls its tools,
reasons and answers): under `auto` it calls `get_weather` twice and answers from the tool_result blocks
in a second turn; every `tool_choice` streams what it answers whole, the `input_json_delta` fragments
putting together each call's input; `stop_sequences` and `max_tokens` end the turn with their stop
reasons; with `--reasoning-parser qwen3` the `<think>` block is a `thinking` block counted in usage;
`x-api-key` is accepted (and a wrong one refused, in Anthropic's error shape); bad requests are 4xx
naming the field while a request in flight finishes untouched; the agent loop of docs/serving.md
(the one the README points to) runs; a request that repeats a long prefix reports the prompt tokens
the prefix cache held as `cache_read_input_tokens`, apart from `input_tokens`, whole and streamed."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.agents.options import AgentOptions
from tests.hang_guard import HANG_S
from tests.infer.agent_models import (
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    qwen_tokenizer,
    with_template,
    write_scripted_agent,
)
from tests.infer.agent_scripts import ANSWER, GREETING, REASONING, RESULTS, call_text, script
from tests.infer.running_server import RunningServer, prefix_hit_tokens

pytest.importorskip("llguidance")

WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
ASK_ONE = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Say hello."}]
PARIS, ROME = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
# greedy: `temperature` is a field of the API that this client's `create` no longer names, so it goes as an extra
BASE = dict(model="agent", max_tokens=96, tools=[WEATHER], extra_body={"temperature": 0})


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted-agent")
    write_scripted_agent(path, QWEN25_TEMPLATE, script())
    return path


def _serve(path, options: AgentOptions, **app):
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=16, max_num_seqs=8))
    return RunningServer(engine, name="agent", agents=options, **app)


def _client(url: str, **keys) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, **({"api_key": "unused"} | keys), max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def agent(scripted):
    with _serve(scripted, AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)) as s:
        yield s


@pytest.fixture(scope="module")
def thinker(scripted, tmp_path_factory):
    path = with_template(scripted, tmp_path_factory.mktemp("qwen3") / "agent", QWEN3_TEMPLATE)
    options = AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    with _serve(path, options) as s:
        yield _client(s.url)


def _prompt(use) -> int:
    """The prompt's tokens: those computed and those the prefix cache held (Anthropic counts them apart)."""
    return use.input_tokens + use.cache_read_input_tokens


def _calls(message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _streamed(client: anthropic.Anthropic, **request):
    """The final message of a stream, checking its events on the way: each call's `input_json_delta`
    fragments put together are its input; the thinking deltas are the thinking block's text."""
    fragments: dict[int, str] = {}
    thought = ""
    with client.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments[event.index] = fragments.get(event.index, "") + event.delta.partial_json
            elif event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thought += event.delta.thinking
        final = stream.get_final_message()
    uses = {i: b for i, b in enumerate(final.content) if b.type == "tool_use"}
    assert {i: json.loads(f) for i, f in fragments.items()} == {i: b.input for i, b in uses.items()}
    assert thought == "".join(b.thinking for b in final.content if b.type == "thinking")
    return final


def test_auto_calls_in_parallel_then_answers_from_the_tool_results(agent):
    client = _client(agent.url)
    first = client.messages.create(messages=ASK, **BASE)
    assert (first.stop_reason, first.stop_sequence, first.role, first.type) == ("tool_use", None, "assistant",
                                                                               "message")
    assert [b.type for b in first.content] == ["tool_use", "tool_use"] and _calls(first) == [PARIS, ROME]
    ids = [b.id for b in first.content]
    assert len(set(ids)) == 2
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": RESULTS[b.input["city"]]} for b in first.content]
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    second = client.messages.create(messages=ASK + [turn, {"role": "user", "content": results}], **BASE)
    assert (_text(second), _calls(second), second.stop_reason) == (ANSWER, [], "end_turn")


MODES = {  # tool_choice -> the calls, and the text, the scripted model's turn comes out as
    "auto": ({"type": "auto"}, [PARIS, ROME], ""),
    "any": ({"type": "any"}, [PARIS, ROME], ""),
    "any-one": ({"type": "any", "disable_parallel_tool_use": True}, [PARIS], ""),
    "tool": ({"type": "tool", "name": "get_weather"}, [PARIS], ""),
    "none": ({"type": "none"}, [], call_text(["Paris", "Rome"])),  # calls not read: the text itself
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_tool_choice_streams_what_it_answers_whole(agent, mode):
    choice, calls, text = MODES[mode]
    client = _client(agent.url)
    request = dict(messages=ASK, tool_choice=choice, **BASE)
    whole = client.messages.create(**request)
    assert (_calls(whole), _text(whole), whole.stop_reason) == (calls, text, "tool_use" if calls else "end_turn")
    stream = _streamed(client, **request)
    assert (_calls(stream), _text(stream), stream.stop_reason) == (calls, text, whole.stop_reason)
    assert [b.type for b in stream.content] == [b.type for b in whole.content]
    assert (_prompt(stream.usage), stream.usage.output_tokens) == (_prompt(whole.usage), whole.usage.output_tokens)


def test_stop_sequences_and_max_tokens_end_the_turn(agent):
    client = _client(agent.url)
    for read in (lambda **r: client.messages.create(**r), lambda **r: _streamed(client, **r)):
        stopped = read(messages=HELLO, stop_sequences=["\x00never", "How"], **BASE)
        assert (_text(stopped), stopped.stop_reason, stopped.stop_sequence) == (
            GREETING[:GREETING.index("How")], "stop_sequence", "How")
        cut = read(messages=HELLO, **{**BASE, "max_tokens": 2})
        assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 2)
        assert GREETING.startswith(_text(cut)) and _text(cut)
        done = read(messages=HELLO, **BASE)
        assert (_text(done), done.stop_reason, done.stop_sequence) == (GREETING, "end_turn", None)


@pytest.mark.parametrize("tool_choice", [{"type": "auto"}, {"type": "any"}])
def test_reasoning_is_a_thinking_block_counted_in_usage(thinker, tool_choice):
    request = dict(messages=ASK_ONE, tool_choice=tool_choice, **BASE)
    whole = thinker.messages.create(**request)
    assert [b.type for b in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
    assert (whole.content[0].thinking, whole.content[0].signature, _calls(whole)) == (REASONING, "", [PARIS])
    thought = len(qwen_tokenizer().encode(REASONING + "\n</think>", add_special_tokens=False).ids)
    assert whole.usage.output_tokens_details.thinking_tokens == thought < whole.usage.output_tokens
    stream = _streamed(thinker, **request)
    assert [(b.type, getattr(b, "thinking", None)) for b in stream.content] == [("thinking", REASONING),
                                                                                ("tool_use", None)]
    assert _calls(stream) == [PARIS] and stream.usage.output_tokens_details.thinking_tokens == thought


def test_thinking_disabled_reaches_the_template(thinker):
    """`thinking: {"type": "disabled"}` is the template's `enable_thinking: false`: the prompt closes the
    block, and the answer comes at once, as text."""
    for read in (lambda **r: thinker.messages.create(**r), lambda **r: _streamed(thinker, **r)):
        answer = read(messages=HELLO, thinking={"type": "disabled"}, **BASE)
        assert ([b.type for b in answer.content], _text(answer)) == (["text"], GREETING)
        assert answer.usage.output_tokens_details.thinking_tokens == 0


def test_x_api_key_is_accepted_where_a_key_is_set(scripted):
    with _serve(scripted, AgentOptions(), api_key="secret") as s:
        for keys in ({"api_key": "secret"}, {"api_key": None, "auth_token": "secret"}):  # x-api-key, Bearer
            answer = _client(s.url, **keys).messages.create(messages=HELLO, tool_choice={"type": "none"}, **BASE)
            assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(s.url, api_key="wrong").messages.create(messages=HELLO, **BASE)
        assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.message
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "secret"}, timeout=HANG_S).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=HANG_S).status_code == 401
        # without --enable-auto-tool-choice, the default tool choice is refused in the API's words
        with pytest.raises(anthropic.BadRequestError, match=r"needs the server started with --enable-auto") as e:
            _client(s.url, api_key="secret").messages.create(messages=HELLO, **BASE)
        assert e.value.body["error"]["param"] == "tool_choice"


def _body(**fields) -> dict:
    return {"model": "agent", "max_tokens": 16, "messages": ASK, "tools": [WEATHER], **fields}


_NO_MAX = {k: v for k, v in _body().items() if k != "max_tokens"}
BAD = {  # body -> (status, param, what the message says)
    "no max_tokens": (_NO_MAX, 400, "max_tokens", "max_tokens is required"),
    "a result of no call": (_body(messages=ASK + [{"role": "assistant", "content": "Let me see."}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "18 C"}]}]), 400,
        "messages", "messages[2].content[0].tool_use_id='toolu_9' is invalid"),
    "an unknown block": (_body(messages=[{"role": "user", "content": [{"type": "video"}]}]), 400, "messages",
                         "messages[0].content[0].type='video' is invalid"),
    "a tool choice naming no tool": (_body(tool_choice={"type": "tool", "name": "nope"}), 400, "tool_choice",
                                     "tool_choice='nope' is invalid: must name an offered tool"),
    "a schema that does not compile": (_body(tools=[{**WEATHER, "input_schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}]), 400, "tools", "tools[0].input_schema="),
    "an unknown model": (_body(model="other"), 404, "model", "model 'other' does not exist"),
    "a prompt past the context": (_body(max_tokens=10**6), 400, "messages", "maximum context length"),
}


def test_bad_requests_are_refused_by_field_and_a_request_in_flight_goes_on(agent):
    client = _client(agent.url)
    with client.messages.stream(messages=ASK, **BASE) as stream:
        events = iter(stream)
        assert next(events).type == "message_start"
        for case, (body, status, param, message) in BAD.items():
            r = httpx.post(agent.url + "/v1/messages", json=body, timeout=HANG_S,
                           headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == status, (case, r.text)
            error = r.json()
            assert error["type"] == "error" and error["error"]["param"] == param, (case, error)
            assert message in error["error"]["message"] and len(error["error"]["message"].splitlines()) == 1
            assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        r = httpx.post(agent.url + "/v1/messages", content=b"{not json", timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        for _ in events:
            pass
        final = stream.get_final_message()
    assert (_calls(final), final.stop_reason) == ([PARIS, ROME], "tool_use")
    assert agent.wait_idle()


def _agent_loop(path: str, after: str) -> str:
    """The first `python` block of the file at `path` (from the repository's root) after `after`."""
    text = (Path(__file__).resolve().parents[2] / path).read_text()
    return text[text.index("```python\n", text.index(after)) + 10:].split("```", 1)[0]


@pytest.mark.parametrize("path, after", [("docs/serving.md", "## Anthropic's Messages API")])
def test_the_documented_agent_loops_run(agent, capsys, path, after):
    """The guide's loop, pointed at this server: the model calls, the loop answers each call, the
    model replies from the results."""
    code = _agent_loop(path, after)
    assert "import anthropic" in code
    code = code.replace("http://127.0.0.1:8000", agent.url).replace('"qwen2.5"', '"agent"')
    exec(compile(code, path, "exec"), {})
    assert capsys.readouterr().out == ANSWER + "\n"



# unlike any other test's prompt, so that the first request finds nothing of it cached
LONG_SYSTEM = ("Quokka archivists of the southern fjords catalogue every barnacle, tide table and lantern "
               "they find, in triplicate, before the evening ferry leaves the harbour for the islands.")
BLOCK = 16  # the block size _serve gives the engine


def test_a_repeated_long_prefix_reports_the_cache_read_tokens(agent):
    client = _client(agent.url)
    request = dict(model="agent", max_tokens=4, system=LONG_SYSTEM, messages=HELLO, extra_body={"temperature": 0})
    first = client.messages.create(**request)
    assert (first.usage.cache_read_input_tokens, first.usage.cache_creation_input_tokens) == (0, 0)
    hits = prefix_hit_tokens(agent.url)
    again = client.messages.create(**request)
    prompt = _prompt(again.usage)
    assert prompt == first.usage.input_tokens > 2 * BLOCK
    # every full block but the one holding the last prompt token, which runs again to give the next token
    assert again.usage.cache_read_input_tokens == (prompt - 1) // BLOCK * BLOCK
    assert again.usage.input_tokens == prompt - again.usage.cache_read_input_tokens
    assert prefix_hit_tokens(agent.url) - hits == again.usage.cache_read_input_tokens
    other = client.messages.create(**(request | {"messages": ASK_ONE}))  # the same system prompt only
    assert 0 < other.usage.cache_read_input_tokens < _prompt(other.usage)
    assert other.usage.cache_read_input_tokens % BLOCK == 0
    stream = _streamed(client, **request)
    assert (stream.usage.input_tokens, stream.usage.cache_read_input_tokens) == (again.usage.input_tokens,
                                                                                 again.usage.cache_read_input_tokens)
