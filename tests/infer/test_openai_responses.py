"""The Responses API's parts without a server: input items fold into the conversation a chat template
expects (a reasoning item, an assistant message and the calls after them one assistant turn; an
output answering its call by the function's name); a continuation puts the stored conversation before
the new input, without the stored instructions; refusals name the field as the request spells it;
the store forgets the least recently used response past its count or character bound; the builder's
events rebuild the response it builds, and the response is the same however the output is cut into
engine steps (text after a call, which opens another message, adds up to the whole parse's content)."""

from __future__ import annotations

import json

import pytest

from tessera.infer.agents.output_parser import output_parser
from tessera.infer.agents.turn import PastCall, TurnMessage
from tessera.infer.agents.turn_output import TurnDecoder
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.openai_responses import responses_request
from tessera.infer.api.response_store import ResponseStore, StoredResponse
from tessera.infer.api.responses_output import ResponseBuilder, response_object
from tessera.infer.engine.sequence import RequestOutput
from tests.infer.agent_streams import cuts
from tests.infer.responses_clients import FLAT_WEATHER

pytest.importorskip("llguidance")

OSLO = PastCall("call_1", "get_weather", {"city": "Oslo"})
ROME = PastCall("call_2", "get_weather", {"city": "Rome"})


def _call_item(call: PastCall) -> dict:
    return {"type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(dict(call.arguments)), "id": "fc_x", "status": "completed"}


def test_items_fold_into_the_conversation_a_template_expects():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo "},
                                                             {"type": "input_text", "text": "and Rome?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Two."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             _call_item(OSLO), _call_item(ROME),
             {"type": "function_call_output", "call_id": "call_1", "output": "3 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21 C"}]},
             {"type": "reasoning", "id": "rs_2", "summary": []},
             {"role": "assistant", "content": "Done."}]
    request = responses_request({"input": items, "tools": [FLAT_WEATHER], "instructions": "Use tools."},
                                ResponseStore())
    expected = (TurnMessage("system", "Be brief."), TurnMessage("user", "Oslo and Rome?"),
                TurnMessage("assistant", "Checking.", (OSLO, ROME), reasoning="Two."),
                TurnMessage("tool", "3 C", tool_call_id="call_1", name="get_weather"),
                TurnMessage("tool", "21 C", tool_call_id="call_2", name="get_weather"),
                TurnMessage("assistant", "Done."))
    strip = [TurnMessage(m.role, m.content, m.tool_calls, m.tool_call_id, m.name, m.reasoning)
             for m in request.turn.messages]
    assert strip == [TurnMessage("system", "Use tools.")] + list(expected)
    assert [m.where for m in request.turn.messages] == ["instructions", "input[0]", "input[1]", "input[2]", "input[6]",
                                                        "input[7]", "input[8]"]  # a turn is where it starts
    assert [m.role for m in request.history] == [m.role for m in expected]  # the instructions are not kept
    assert request.turn.tools[0].template_entry() == {"type": "function", "function": {
        k: FLAT_WEATHER[k] for k in ("name", "description", "parameters")}}


def test_a_continuation_follows_the_stored_conversation_without_its_instructions():
    store = ResponseStore()
    earlier = (TurnMessage("user", "Oslo?"), TurnMessage("assistant", None, (OSLO,)))
    store.put(StoredResponse({"id": "resp_1"}, earlier))
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "3 C"}
    request = responses_request({"input": [answer], "previous_response_id": "resp_1", "instructions": "Now."}, store)
    assert [m.role for m in request.turn.messages] == ["system", "user", "assistant", "tool"]
    assert request.history[:2] == earlier and request.history[2].name == "get_weather"
    assert request.echo["previous_response_id"] == "resp_1" and request.echo["instructions"] == "Now."


BAD = {  # body -> field named, words of the message
    "unknown item": ({"input": [{"type": "computer_call"}]}, "input", "input[0].type='computer_call' is invalid"),
    "unknown part": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input",
                     "input[0].content[0].type='input_file' is invalid"),
    "call id": ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
                "input[0].call_id=None is invalid"),
    "unanswered": ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input",
                   "input[0].call_id='c9' is invalid: must be the id of a call"),
    "choice shape": ({"input": "x", "tools": [FLAT_WEATHER], "tool_choice": {"type": "function",
                                                                             "function": {"name": "get_weather"}}},
                     "tool_choice", "'none', 'auto', 'required' or {'type': 'function', 'name': ...}"),
    "no tools": ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    "duplicate": ({"input": "x", "tools": [FLAT_WEATHER, FLAT_WEATHER]}, "tools", "must be unique"),
    "strict": ({"input": "x", "tools": [{**FLAT_WEATHER, "strict": "yes"}]}, "tools", "tools[0].strict='yes'"),
    "include": ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "includes nothing more"),
    "conversation": ({"input": "x", "conversation": "conv_1"}, "conversation", "does not support it"),
    "stream": ({"input": "x", "stream": "yes"}, "stream", "'stream' must be a boolean"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refusals_name_the_field(case):
    body, field, words = BAD[case]
    with pytest.raises(ProtocolError) as refused:
        responses_request(body, ResponseStore())
    assert refused.value.param == field and words in str(refused.value), str(refused.value)


def test_an_unknown_previous_response_is_a_404_naming_it():
    with pytest.raises(ProtocolError, match="previous_response_id='resp_x' is not a stored response") as refused:
        responses_request({"input": "x", "previous_response_id": "resp_x"}, ResponseStore())
    assert (refused.value.status, refused.value.param) == (404, "previous_response_id")


def _entry(i: int, text: str = "") -> StoredResponse:
    return StoredResponse({"id": f"resp_{i}"}, (TurnMessage("user", text),))


def test_the_store_forgets_the_least_recently_used_past_its_bounds():
    store = ResponseStore(max_entries=3)
    for i in range(3):
        store.put(_entry(i))
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(_entry(3))
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [True, False, True, True]
    size = _entry(0, "x" * 100).chars
    store = ResponseStore(max_chars=2 * size)
    for i in range(3):
        store.put(_entry(i, "x" * 100))
    assert len(store) == 2 and store.get("resp_0") is None
    store.put(_entry(9, "x" * 3 * size))  # larger than the whole bound: not kept, nothing evicted for it
    assert len(store) == 2 and store.get("resp_9") is None


REASONED = '<think>\nThe user wants two cities.\n</think>\n\nChecking both.\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def _build(pieces: list[str], reason: str = "stop") -> tuple[dict, list[dict]]:
    """The response and the events of an output arriving as `pieces`, one engine step each."""
    builder = ResponseBuilder(response_object("resp_1", "m", {}), TurnDecoder(output_parser("qwen3", "hermes"),
                                                                               False, None))
    events, text = builder.start(), ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        out = RequestOutput("r", [0], piece, text, [0, 1, 2], last, reason if last else None, 7)
        events += builder.step(out)
    return builder.response, events


VARYING = ("id", "item_id", "call_id", "created_at", "completed_at")  # ids and clock seconds


def _no_ids(obj):
    if isinstance(obj, dict):
        return {k: _no_ids(v) for k, v in obj.items() if k not in VARYING}
    return [_no_ids(v) for v in obj] if isinstance(obj, list) else obj


def test_the_response_is_the_same_at_every_cut_and_its_events_rebuild_it():
    whole, _ = _build([REASONED])
    assert [(o["type"], o["status"]) for o in whole["output"]] == [("reasoning", "completed"), ("message", "completed"),
                                                                   ("function_call", "completed")] + \
        [("function_call", "completed")]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants two cities."}]
    assert whole["output"][1]["content"][0]["text"] == "Checking both."
    assert [o["arguments"] for o in whole["output"][2:]] == ['{"city": "Oslo"}', '{"city": "Rome"}']
    assert (whole["status"], whole["usage"]["output_tokens"], whole["usage"]["input_tokens"]) == ("completed", 3, 7)
    for pieces in cuts(REASONED):
        response, events = _build(pieces)
        assert _no_ids(response) == _no_ids(whole), pieces
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == response["output"] and events[-1]["response"] == response
        texts = ["".join(e["delta"] for e in events if e.get("output_index") == i and e["type"].endswith("text.delta"))
                 for i in range(2)]
        assert texts == [o["content"][0]["text"] for o in response["output"][:2]]


def test_a_cut_off_output_is_incomplete_and_an_empty_one_a_message():
    response, events = _build(["<think>\nStill thin", "king"], reason="length")
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [(o["type"], o["status"]) for o in response["output"]] == [("reasoning", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    response, events = _build([""])
    assert [(o["type"], o["content"][0]["text"]) for o in response["output"]] == [("message", "")]
    assert events[-1]["type"] == "response.completed"


def test_text_after_a_call_is_the_whole_parse_content_at_every_cut():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\nDone.'
    _, content, calls = output_parser("qwen3", "hermes").parse(text, False)
    for pieces in cuts(text, every_position=False):
        response, _ = _build(pieces)
        messages = [o["content"][0]["text"] for o in response["output"] if o["type"] == "message"]
        assert "".join(messages) == content and len(calls) == 1, pieces
        assert [o["arguments"] for o in response["output"] if o["type"] == "function_call"] == [calls[0].arguments]
