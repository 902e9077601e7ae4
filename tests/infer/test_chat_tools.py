"""Tool calls and reasoning on /v1/chat/completions, through the official `openai` client against a
real server on 127.0.0.1, served from a scripted agent (agent_scripts.py: a tiny model that really
calls its tools, reasons and answers): under `auto` it calls `get_weather` twice in parallel and
answers from the results in a second turn, or answers in text; every `tool_choice` mode, streamed
and not, the streamed call deltas concatenating to exactly the non-streamed calls; with
`--reasoning-parser qwen3` the `<think>` block is `reasoning_content`, counted in usage, apart from
the call after it, and `chat_template_kwargs` reach the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.agents.options import AgentOptions
from tests.infer.agent_models import (
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    qwen_tokenizer,
    with_template,
    write_scripted_agent,
)
from tests.infer.agent_scripts import (
    ANSWER,
    ASK,
    ASK_ONE,
    GREETING,
    HELLO,
    REASONING,
    RESULTS,
    TOOLS,
    call_text,
    script,
)
from tests.infer.chat_clients import client, streamed, whole
from tests.infer.running_server import RunningServer

pytest.importorskip("llguidance")

PARIS, ROME = ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted-agent")
    write_scripted_agent(path, QWEN25_TEMPLATE, script())
    return path


def _serve(path, options: AgentOptions):
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=16, max_num_seqs=8))
    return RunningServer(engine, name="agent", agents=options)


@pytest.fixture(scope="module")
def agent(scripted):
    with _serve(scripted, AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)) as s:
        yield client(s.url)


@pytest.fixture(scope="module")
def thinker(scripted, tmp_path_factory):
    path = with_template(scripted, tmp_path_factory.mktemp("qwen3") / "agent", QWEN3_TEMPLATE)
    options = AgentOptions(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    with _serve(path, options) as s:
        yield client(s.url)


def test_auto_calls_in_parallel_then_answers_from_the_results(agent):
    first = agent.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    calls = [(t.function.name, t.function.arguments) for t in message.tool_calls]
    assert calls == [PARIS, ROME]
    ids = [t.id for t in message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    results = [{"role": "tool", "tool_call_id": t.id, "content": RESULTS[json.loads(t.function.arguments)["city"]]}
               for t in message.tool_calls]
    messages = ASK + [message.model_dump(exclude_none=True)] + results  # the assistant turn as the client has it
    second = whole(agent, model="agent", messages=messages, tools=TOOLS, temperature=0)
    assert (second.content, second.calls, second.finish_reason) == (ANSWER, [], "stop")


def test_auto_answers_in_text_when_the_model_writes_no_call(agent):
    answer = whole(agent, model="agent", messages=HELLO, tools=TOOLS, temperature=0)
    assert (answer.content, answer.calls, answer.finish_reason) == (GREETING, [], "stop")


NAMED = {"type": "function", "function": {"name": "get_weather"}}
MODES = {  # request fields -> the calls, and the content, the scripted model's turn comes out as
    "auto": ({}, [PARIS, ROME], ""),
    "required": ({"tool_choice": "required"}, [PARIS, ROME], ""),
    "required-one": ({"tool_choice": "required", "parallel_tool_calls": False}, [PARIS], ""),
    "named": ({"tool_choice": NAMED}, [PARIS], ""),
    "none": ({"tool_choice": "none"}, [], call_text(["Paris", "Rome"])),  # calls not read: the text itself
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_tool_choice_streams_what_it_answers_whole(agent, mode):
    fields, calls, content = MODES[mode]
    request = dict(model="agent", messages=ASK, tools=TOOLS, temperature=0, **fields)
    answer = whole(agent, **request)
    assert (answer.calls, answer.content, answer.finish_reason) == (calls, content, "tool_calls" if calls else "stop")
    stream = streamed(agent, **request)
    assert (stream.calls, stream.content, stream.finish_reason) == (answer.calls, answer.content, answer.finish_reason)
    assert stream.usage.completion_tokens == answer.usage.completion_tokens


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_reasoning_is_kept_apart_from_the_call_and_counted(thinker, tool_choice):
    request = dict(model="agent", messages=ASK_ONE, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    answer = whole(thinker, **request)
    assert (answer.reasoning, answer.content, answer.calls, answer.finish_reason) == (REASONING, "", [PARIS],
                                                                                      "tool_calls")
    thought = len(qwen_tokenizer().encode(REASONING + "\n</think>", add_special_tokens=False).ids)
    assert answer.usage.completion_tokens_details.reasoning_tokens == thought < answer.usage.completion_tokens
    stream = streamed(thinker, **request)
    assert (stream.reasoning, stream.content, stream.calls) == (answer.reasoning, answer.content, answer.calls)
    assert stream.usage.completion_tokens_details.reasoning_tokens == thought


def test_chat_template_kwargs_reach_the_template(thinker):
    """`enable_thinking: false` closes the block in the prompt: the answer comes at once, as content."""
    for read in (whole, streamed):
        answer = read(thinker, model="agent", messages=HELLO, tools=TOOLS, temperature=0,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert (answer.reasoning, answer.content, answer.calls) == ("", GREETING, [])
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0


def _guide_agent_loop() -> str:
    """The `python` block of the serving guide's tool-call section (the README points to it)."""
    guide = (Path(__file__).resolve().parents[2] / "docs/serving.md").read_text()
    return guide[guide.index("```python\n", guide.index("## Tool calls and reasoning")) + 10:].split("```", 1)[0]


def test_the_guides_agent_loop_runs(agent, capsys):
    """The serving guide's loop, pointed at this server: the model calls, the loop answers each call, the
    model replies from the results."""
    code = _guide_agent_loop().replace("http://127.0.0.1:8000/v1", str(agent.base_url)).replace('"qwen2.5"', '"agent"')
    exec(compile(code, "docs/serving.md", "exec"), {})
    assert capsys.readouterr().out == ANSWER + "\n"
