"""The Messages API's protocol, without a server: a request reads into the agent turn its chat template
renders as transformers renders the same conversation, each refusal names the field as Anthropic's API
spells it, and the streamed events, folded by the official `anthropic` client's own accumulator, give
the whole message at every cut of the output (the texts of text blocks put together, where the model
writes text after its calls)."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message

from tessera.data.tokenizer import Tokenizer
from tessera.infer.agents.options import AgentOptions
from tessera.infer.agents.turn import PastCall, ToolChoice, TurnMessage
from tessera.infer.agents.turn_plan import AgentTurns
from tessera.infer.api.anthropic_messages import messages_request
from tessera.infer.api.anthropic_output import MessageEvents, error_body, message_object, stop_reason, usage
from tessera.infer.api.openai_protocol import ProtocolError
from tests.infer.agent_models import QWEN3_TEMPLATE, QWEN25_TEMPLATE, qwen_tokenizer
from tests.infer.agent_streams import cuts

pytest.importorskip("llguidance")

WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
LOOP = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Paris: ask the tool.", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
        {"type": "text", "text": "And tomorrow?"}]},
]


def _body(**fields) -> dict:
    return {"model": "m", "max_tokens": 32, "messages": LOOP, "tools": [WEATHER], **fields}


def test_a_request_reads_into_the_turn_the_template_renders():
    from transformers import PreTrainedTokenizerFast

    request = messages_request(_body(system=[{"type": "text", "text": "Be brief.", "cache_control": {}}],
                                     tool_choice={"type": "auto"}, thinking={"type": "disabled"}, stream=True))
    turn = request.turn
    assert turn.messages == (
        TurnMessage("system", "Be brief.", where="system"),
        TurnMessage("user", "Weather in Paris?", where="messages[0]"),
        TurnMessage("assistant", None, (PastCall("toolu_1", "get_weather", {"city": "Paris"}),),
                    reasoning="Paris: ask the tool.", where="messages[1]"),
        TurnMessage("tool", "18 C, sunny", tool_call_id="toolu_1", name="get_weather", where="messages[2].content[0]"),
        TurnMessage("user", "And tomorrow?", where="messages[2]"))
    assert (turn.choice, turn.template_kwargs, request.stream) == (ToolChoice("auto"), {"enable_thinking": False}, True)
    assert turn.template_tools() == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city", "parameters": WEATHER["input_schema"]}}]
    # the same conversation as Chat Completions sends it, rendered by transformers
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Paris: ask the tool.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    for template in (QWEN25_TEMPLATE, QWEN3_TEMPLATE):
        plan = _turns(template, tool_call_parser="hermes", enable_auto_tool_choice=True).prepare(turn)
        hf = PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer(), chat_template=template)
        assert plan.prompt == hf.apply_chat_template(chat, tools=turn.template_tools(), add_generation_prompt=True,
                                                     tokenize=False, enable_thinking=False)


@pytest.mark.parametrize("choice,expected,parallel", [
    ({"type": "auto"}, ToolChoice("auto"), True),
    ({"type": "any"}, ToolChoice("required"), True),
    ({"type": "any", "disable_parallel_tool_use": True}, ToolChoice("required"), False),
    ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather"), True),
    ({"type": "none"}, ToolChoice("none"), True),
    (None, ToolChoice("auto"), True),  # the default where tools are offered
])
def test_tool_choices_and_sampling_fields(choice, expected, parallel):
    request = messages_request(_body(tool_choice=choice, stop_sequences=["\n\n", "END"], temperature=0.5,
                                     top_p=0.9, top_k=7))
    assert (request.turn.choice, request.turn.parallel_tool_calls) == (expected, parallel)
    params = request.params
    assert (params.max_tokens, params.stop, params.temperature, params.top_p, params.top_k) == (
        32, ["\n\n", "END"], 0.5, 0.9, 7)


def _without(key: str) -> dict:
    body = _body()
    del body[key]
    return body


def _messages(*messages) -> dict:
    return _body(messages=list(messages))


ASK = {"role": "user", "content": "Weather in Paris?"}
REFUSED = {  # body -> (param, what the message says)
    "no max_tokens": (_without("max_tokens"), "max_tokens", r"max_tokens is required"),
    "max_tokens 0": (_body(max_tokens=0), "max_tokens", r"max_tokens=0 is invalid: must be an integer >= 1"),
    "a result of no call": (_messages(ASK, {"role": "assistant", "content": "Let me see."}, {"role": "user",
                                                                                             "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "18 C"}]}), "messages",
        r"messages\[2\].content\[0\].tool_use_id='toolu_9' is invalid: must be the id of a call"),
    "an unknown block": (_messages({"role": "user", "content": [{"type": "video", "url": "x"}]}), "messages",
                         r"messages\[0\].content\[0\].type='video' is invalid: this message's blocks are 'text', "
                         r"'tool_result'"),
    "a tool_use in a user turn": (_messages({"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}), "messages",
        r"messages\[0\].content\[0\].type='tool_use' is invalid"),
    "a tool choice naming no tool": (_body(tool_choice={"type": "tool", "name": "nope"}), "tool_choice",
                                     r"tool_choice='nope' is invalid: must name an offered tool"),
    "an unknown tool choice": (_body(tool_choice={"type": "required"}), "tool_choice",
                               r"tool_choice.type='required' is invalid: must be 'auto', 'any', 'tool' or 'none'"),
    "a bad input schema": (_body(tools=[{**WEATHER, "input_schema": {"type": "array"}}]), "tools",
                           r"tools\[0\].input_schema=.* is invalid: must describe the arguments object"),
    "no input schema": (_body(tools=[{"name": "get_weather"}]), "tools", r"tools\[0\].input_schema is required"),
    "a server tool": (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools",
                      r"tools\[0\].type='web_search_20250305' is invalid: only custom tools"),
    "17 stop sequences": (_body(stop_sequences=["x"] * 17), "stop_sequences", r"at most 16 non-empty strings"),
    "an assistant last": (_messages(ASK, {"role": "assistant", "content": "It is"}), "messages",
                          r"messages\[1\].role='assistant' is invalid: the last message must be the user's"),
    "a system role": (_messages({"role": "system", "content": "x"}, ASK), "messages",
                      r"messages\[0\].role='system' is invalid"),
    "a bad is_error": (_messages(ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}), "messages",
        r"messages\[2\].content\[0\].is_error='yes' is invalid: must be a boolean"),
    "a bad thinking": (_body(thinking={"type": "on"}), "thinking", r"thinking.type='on' is invalid"),
    "a container": (_body(container="c"), "container", r"container is not served"),
    "a temperature string": (_body(temperature="hot"), "temperature", r"temperature='hot' is invalid: must be"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_the_field_as_the_api_spells_it(case):
    body, param, message = REFUSED[case]
    with pytest.raises(ProtocolError, match=message) as e:
        messages_request(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert len(str(e.value).splitlines()) == 1


def test_is_error_results_say_so_and_errors_have_anthropics_shape():
    body = _messages(ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                                      "is_error": True}]})
    assert messages_request(body).turn.messages[-1].content == "Error: no such city"
    assert error_body("max_tokens is required", 400, "max_tokens") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens is required",
                                   "param": "max_tokens"}}
    assert error_body("no", 401)["error"]["type"] == "authentication_error"
    assert error_body("boom", 500)["error"]["type"] == "api_error"


def test_stop_reasons():
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", None) == ("end_turn", None)


def _turns(template: str, **options) -> AgentTurns:
    tok = Tokenizer(qwen_tokenizer(), eos_token="<|im_end|>", chat_template=template)
    return AgentTurns(AgentOptions(**options), tok)


class _Out:
    """An engine output as TurnDecoder reads it."""

    def __init__(self, delta: str, text: str, token_ids: list[int], finished: bool, reason: str | None):
        self.delta, self.text, self.token_ids = delta, text, token_ids
        self.finished, self.finish_reason = finished, reason


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
OUTPUTS = {  # the output -> the whole message's blocks
    "reasoning, text and two calls": ("The user wants the weather.\n</think>\n\nChecking.\n" + CALL % "Paris"
                                      + "\n" + CALL % "Rome", ["thinking", "text", "tool_use", "tool_use"]),
    "text after the call": ("Short.</think>\n\nChecking.\n" + CALL % "Paris" + "\nDone.",
                            ["thinking", "text", "tool_use"]),
    "text only": ("Fine.</think>\n\nHello there.", ["thinking", "text"]),
}


def _blocks(message: Message) -> tuple:
    """The message's thinking, its text blocks put together (the stream's text after the calls comes in a
    block of its own) and its calls without their ids (a stream and a whole parse draw their own)."""
    content = message.content
    return ("".join(b.thinking for b in content if b.type == "thinking"),
            "".join(b.text for b in content if b.type == "text"),
            [(b.name, b.input) for b in content if b.type == "tool_use"])


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_the_streamed_events_fold_into_the_whole_message_at_every_cut(case):
    text, kinds = OUTPUTS[case]
    turns = _turns(QWEN3_TEMPLATE, tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    request = messages_request(_body(messages=[ASK]))
    plan = turns.prepare(request.turn)
    ids = turns.tokenizer.encode(text, add_special_tokens=False)
    read = plan.output(_Out("", text, ids, True, "stop"))
    stop = stop_reason(read.finish_reason, None)
    use = usage(9, len(ids), read.reasoning_tokens)
    whole = Message.model_validate(message_object("msg_1", "m", read, stop, use))
    assert [b.type for b in whole.content] == kinds and whole.content[0].signature == ""
    assert whole.stop_reason == ("tool_use" if read.tool_calls else "end_turn")
    for pieces in cuts(text, every_position=True, random_cuts=5):
        decoder, events = plan.decoder(), MessageEvents("msg_1", "m", 9)
        sent = events.start()
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            sent += events.step(decoder.step(_Out(piece, text if last else "", ids if last else [], last,
                                                  "stop" if last else None)))
        sent += events.end(stop, usage(9, len(ids), decoder.reasoning_tokens))
        _check_order(sent)
        snapshot, buffers = None, {}
        for event in sent:
            json.dumps(event)  # each is sent as JSON
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
        folded = Message.model_validate(snapshot.to_dict())
        assert _blocks(folded) == _blocks(whole)
        assert (folded.stop_reason, folded.usage) == (whole.stop_reason, whole.usage)
        inputs = {i: json.loads(b.decode()) for i, b in buffers.items()}  # partial_json put together
        assert list(inputs.values()) == [b.input for b in folded.content if b.type == "tool_use"]


def _check_order(events: list[dict]) -> None:
    """message_start first, message_delta and message_stop last; each block started, given deltas and
    stopped in turn, its index one more than the last one's."""
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == next_index
            open_index, next_index = e["index"], next_index + 1
        else:
            assert e["index"] == open_index, e
            if e["type"] == "content_block_stop":
                open_index = None
    assert open_index is None
