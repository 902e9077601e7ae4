"""The shared layer of the agent APIs, without a server: the tool-call grammar of every format
accepts exactly the calls the family's template writes (valid arguments, offered names, one call
where parallel calls are off, text before a call under `auto`), naming added tokens as tokens; a
turn is rendered as transformers' `apply_chat_template(tools=...)` renders it; a turn's refusals name
the field; a turn's output read delta by delta equals the whole reading at every cut, reasoning
tokens counted as the detokenizer decodes them."""

from __future__ import annotations

import json

import pytest

from tessera.config.errors import ConfigError, RequestError
from tessera.data.tokenizer import Tokenizer
from tessera.infer.agents import mistral
from tessera.infer.agents.options import AgentOptions
from tessera.infer.agents.tool_grammar import literal, tool_grammar
from tessera.infer.agents.tool_parsers import TOOL_CALL_PARSERS
from tessera.infer.agents.turn import AgentTurn, PastCall, Tool, ToolChoice, TurnMessage
from tessera.infer.agents.turn_output import TurnOutput, reasoning_end
from tessera.infer.agents.turn_plan import AgentTurns
from tessera.infer.sampling.params import SamplingParams
from tests.infer.agent_models import QWEN3_TEMPLATE, QWEN25_TEMPLATE, qwen_tokenizer
from tests.infer.agent_streams import cuts

llg = pytest.importorskip("llguidance")

BOUNDED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5},
                                             "unit": {"enum": ["c", "f"]}},
           "required": ["n", "unit"], "additionalProperties": False}
TOOLS = [("f", BOUNDED), ("ns.get", {"type": "object"})]
# the formats' markers as added tokens, as their families' tokenizers have them
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]


@pytest.fixture(scope="module")
def tokenizers():
    """(tokenizers.Tokenizer, its llguidance tokenizer) with and without the formats' markers as tokens."""
    from tokenizers import AddedToken

    plain = qwen_tokenizer()
    marked = qwen_tokenizer()
    marked.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS])
    out = {}
    for name, tok in (("plain", plain), ("marked", marked)):
        out[name] = tok, llg.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[4097])
    return out


def _added(tok) -> dict[str, int]:
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items()}


def _accepts(grammar: str, tok, lltok, text: str) -> bool:
    """Whether the grammar takes the tokenizer's tokens of `text` and may end there."""
    matcher = llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False).ids
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


LAYOUTS = [(name, p.layout) for name, p in TOOL_CALL_PARSERS.items()] + [("mistral", mistral.LIST_LAYOUT)]


@pytest.mark.parametrize("kind", ["plain", "marked"])
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LAYOUTS)])
def test_the_call_grammar_takes_the_templates_calls_and_nothing_else(tokenizers, kind, name, layout):
    tok, lltok = tokenizers[kind]
    parser, tokens = TOOL_CALL_PARSERS[name], _added(tok)
    two = layout.render([("f", '{"n": 3, "unit": "c"}'), ("ns.get", "{}")])
    one, bad = layout.render([("f", '{"n": 2, "unit": "f"}')]), layout.render([("f", '{"n": 9, "unit": "c"}')])
    unknown = layout.render([("g", "{}")])
    required = tool_grammar(layout, TOOLS, parallel=True, tokens=tokens)
    assert _accepts(required, tok, lltok, two) and _accepts(required, tok, lltok, one)
    assert not _accepts(required, tok, lltok, bad) and not _accepts(required, tok, lltok, unknown)
    assert not _accepts(required, tok, lltok, "Sure, here it is.")  # required: a call, not text
    single = tool_grammar(layout, TOOLS, parallel=False, tokens=tokens)
    assert _accepts(single, tok, lltok, one) and not _accepts(single, tok, lltok, two)
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(two).calls] == [("f", {"n": 3, "unit": "c"}),
                                                                                      ("ns.get", {})]
    marker = getattr(parser.fmt, "MARKER", None)
    auto = tool_grammar(layout, TOOLS, parallel=True, auto=True, marker=marker, tokens=tokens)
    assert _accepts(auto, tok, lltok, "Sure, I can help.") and _accepts(auto, tok, lltok, two)
    lead = "Let me check.\n" if marker else ""  # text before the calls, where the format marks them
    assert _accepts(auto, tok, lltok, lead + two) and not _accepts(auto, tok, lltok, lead + bad)
    reasoned = tool_grammar(layout, TOOLS, parallel=True, reasoning="opened", tokens=tokens)
    assert _accepts(reasoned, tok, lltok, "hmm, f fits.</think>\n\n" + one)
    assert not _accepts(reasoned, tok, lltok, one)  # the block the prompt opened closes first


def test_literals_name_added_tokens_as_tokens():
    assert literal("[TOOL_CALLS]get[ARGS]", {"[TOOL_CALLS]": 5, "[ARGS]": 6}) == '<[5]> "get" <[6]>'
    assert literal('a\n"b"', {}) == '"a\\n\\"b\\""'
    assert literal("<tool_call>\n{", {"<tool_call>": 9, "<tool": 3}) == '<[9]> "\\n{"'


def _turns(template: str, **options) -> AgentTurns:
    tok = qwen_tokenizer()
    return AgentTurns(AgentOptions(**options), Tokenizer(tok, eos_token="<|im_end|>", chat_template=template))


WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
               "The weather of a city")
LOOP = (TurnMessage("system", "Be brief."), TurnMessage("user", "Weather in Paris?"),
        TurnMessage("assistant", None, (PastCall("call_1", "get_weather", {"city": "Paris"}),)),
        TurnMessage("tool", "18 C, sunny", tool_call_id="call_1"))


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, QWEN3_TEMPLATE], ids=["qwen2.5", "qwen3"])
def test_a_turn_renders_as_transformers_renders_it(template):
    from transformers import PreTrainedTokenizerFast

    turn = AgentTurn(LOOP, (WEATHER,), ToolChoice("auto"), template_kwargs={"enable_thinking": False})
    plan = _turns(template, tool_call_parser="hermes", enable_auto_tool_choice=True).prepare(turn)
    hf = PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer(), chat_template=template)
    expected = hf.apply_chat_template(turn.template_messages(), tools=[WEATHER.template_entry()],
                                      add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert plan.prompt == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in plan.prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in plan.prompt
    assert '"description": "The weather' in plan.prompt


def test_a_turns_refusals_name_the_field():
    with pytest.raises(RequestError, match=r"tool_choice='nope' is invalid: must name an offered tool") as e:
        AgentTurn(LOOP, (WEATHER,), ToolChoice("function", "nope"))
    assert e.value.field == "tool_choice"
    with pytest.raises(RequestError, match=r"messages\[1\].tool_call_id='call_9' is invalid: must be the id of a call"):
        AgentTurn((TurnMessage("user", "hi"), TurnMessage("tool", "x", tool_call_id="call_9")))
    with pytest.raises(RequestError, match=r"tools\[0\].parameters=.* is invalid: the schema does not compile"):
        AgentTurn(LOOP, (Tool("t", {"type": "object", "properties": {"a": {"type": "nonsense"}}}),))
    with pytest.raises(RequestError, match=r"len\(tools\)=300 is invalid: at most 256"):
        AgentTurn(LOOP, tuple(Tool(f"t{i}") for i in range(300)))
    with pytest.raises(RequestError, match=r"tools\[0\].name='a b' is invalid"):
        AgentTurn(LOOP, (Tool("a b"),))
    with pytest.raises(RequestError, match=r"template_kwargs=\['tools'\] is invalid"):
        AgentTurn(LOOP, template_kwargs={"tools": []})
    turns = _turns(QWEN25_TEMPLATE, tool_call_parser="hermes")
    with pytest.raises(RequestError, match="needs the server started with --enable-auto-tool-choice") as e:
        turns.prepare(AgentTurn(LOOP, (WEATHER,)))
    assert e.value.field == "tool_choice"
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        AgentOptions(enable_auto_tool_choice=True)


def test_refusals_name_fields_as_the_request_spells_them():
    """A protocol whose fields are named otherwise (the Messages API's) gets its own names back."""
    spelling = {"parameters": "input_schema", "tool_call_id": "tool_use_id"}
    with pytest.raises(RequestError, match=r"tools\[0\].input_schema=.* is invalid: must describe") as e:
        AgentTurn(LOOP, (Tool("t", {"type": "array"}),), spelling=spelling)
    assert e.value.field == "tools"
    result = TurnMessage("tool", "x", tool_call_id="toolu_9", where="messages[1].content[0]")
    with pytest.raises(RequestError, match=r"messages\[1\].content\[0\].tool_use_id='toolu_9' is invalid") as e:
        AgentTurn((TurnMessage("user", "hi"), result), spelling=spelling)
    assert e.value.field == "messages"


class _Out:
    """An engine output as TurnDecoder reads it."""

    def __init__(self, delta: str, text: str, token_ids: list[int], finished: bool, reason: str | None):
        self.delta, self.text, self.token_ids = delta, text, token_ids
        self.finished, self.finish_reason = finished, reason


OUTPUT = ("The user wants the weather.\n</think>\n\nChecking.\n<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_a_block_the_prompt_opened_or_closed_shapes_the_constrained_output(tokenizers):
    """Qwen3's prompt opens `<think>` (the calls come after `</think>`), or with `enable_thinking: false`
    holds an empty closed block (the calls come at once: no second block)."""
    tok, lltok = tokenizers["plain"]
    turns = _turns(QWEN3_TEMPLATE, tool_call_parser="hermes", reasoning_parser="qwen3")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    thinking = turns.prepare(AgentTurn(LOOP[:2], (WEATHER,), ToolChoice("required")))
    assert thinking.opened and _accepts(thinking.guided_grammar, tok, lltok, "Rome it is.</think>\n\n" + call)
    assert not _accepts(thinking.guided_grammar, tok, lltok, call)
    closed = turns.prepare(AgentTurn(LOOP[:2], (WEATHER,), ToolChoice("required"),
                                     template_kwargs={"enable_thinking": False}))
    assert not closed.opened and _accepts(closed.guided_grammar, tok, lltok, call)
    assert not _accepts(closed.guided_grammar, tok, lltok, "<think>hmm</think>" + call)
    free = turns.prepare(AgentTurn(LOOP[:2], (WEATHER,), ToolChoice("none")))
    assert free.guided_grammar is None and free.reads_reasoning and free.parser.tools is None


def test_the_streamed_turn_equals_the_whole_at_every_cut():
    turns = _turns(QWEN3_TEMPLATE, tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    plan = turns.prepare(AgentTurn(LOOP[:2], (WEATHER,)))
    assert plan.opened and plan.sampling(SamplingParams()).skip_special_tokens is False
    tok = turns.tokenizer
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    whole = plan.output(_Out("", OUTPUT, ids, True, "stop"))
    assert (whole.reasoning, whole.content, whole.finish_reason) == ("The user wants the weather.", "Checking.",
                                                                     "tool_calls")
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    end = reasoning_end(OUTPUT, opened=True)
    assert whole.reasoning_tokens == len(tok.encode(OUTPUT[:end], add_special_tokens=False))
    for pieces in cuts(OUTPUT, every_position=True, random_cuts=5):
        decoder = plan.decoder()
        parts = [decoder.step(_Out(p, "", [], False, None)) for p in pieces[:-1]]
        parts.append(decoder.step(_Out(pieces[-1], OUTPUT, ids, True, "stop")))
        streamed = TurnOutput("".join(p.reasoning for p in parts), "".join(p.content for p in parts),
                              whole.tool_calls, parts[-1].finish_reason, decoder.reasoning_tokens)
        calls = [(d.name, d.arguments) for p in parts for d in p.tool_calls]
        assert streamed == whole and calls == [("get_weather", ""), (None, '{"city": "Paris"}')]

