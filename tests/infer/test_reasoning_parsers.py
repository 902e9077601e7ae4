"""Reasoning parsers (tessera/infer/agents/reasoning.py) and the composer (output_parser.py): `qwen3`
and `deepseek_r1` split a `<think>` output as the families' templates write it back (reasoning without
its edge newlines, content after `</think>` without its leading ones); where the prompt opened the
block (R1's template, Qwen3's thinking-only ones: `opens_reasoning` of the rendered prompt) everything
up to `</think>` is reasoning, all of it when the block never closes; Qwen3 with `enable_thinking:
false` gives all content. The stream equals the whole parse for every cut of the text. Tool calls are
parsed only after the reasoning: a call inside the block stays reasoning, the calls after it are calls,
streamed as whole for every cut. Unknown names are refused naming the option."""

from __future__ import annotations

import pytest

from tessera.config.errors import ConfigError
from tessera.infer.agents.output_parser import output_parser
from tessera.infer.agents.reasoning import REASONING_PARSERS, opens_reasoning, reasoning_parser
from tests.infer.agent_streams import cuts, joined_calls, numbered_ids

# Generation prompts as the templates end them: Qwen3 (thinking on; off), Qwen3-2507 thinking-only, DeepSeek-R1.
QWEN3 = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3 + "<think>\n\n</think>\n\n"
QWEN3_THINKING_ONLY = QWEN3 + "<think>\n"
DEEPSEEK_R1 = "<｜begin▁of▁sentence｜><｜User｜>Capital of France?<｜Assistant｜><think>\n"


def qwen3_turn(reasoning: str, content: str) -> str:
    """Qwen3's template writing a turn with `reasoning_content` back (what the model was trained on)."""
    return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")


def assert_stream_is_whole(name: str, text: str, opened: bool | None):
    parser = reasoning_parser(name)
    whole = parser.parse(text, opened)
    for pieces in cuts(text):
        stream = parser.stream(opened)
        outs = [stream.feed(p) for p in pieces] + [stream.finish()]
        got = ("".join(o.reasoning for o in outs), "".join(o.content for o in outs))
        assert got == tuple(whole) == (stream.reasoning, stream.content), pieces
    return tuple(whole)


def test_the_prompt_says_whether_it_opened_the_block():
    assert not opens_reasoning(QWEN3) and not opens_reasoning(QWEN3_NO_THINKING)
    assert opens_reasoning(QWEN3_THINKING_ONLY) and opens_reasoning(DEEPSEEK_R1)


@pytest.mark.parametrize("reasoning,content", [
    ("The user asks for the capital of France.\nThat is Paris.", "Paris."),
    ("", "Paris."), ("  indented\n\nparagraphs  ", " Paris, \n"), ("only thought", ""),
    ("a <think> inside", "and </think> after"),
])
def test_qwen3_splits_what_its_template_writes(reasoning, content):
    text = qwen3_turn(reasoning, content)
    assert assert_stream_is_whole("qwen3", text, opens_reasoning(QWEN3)) == (reasoning, content)
    assert assert_stream_is_whole("qwen3", "\n " + text, None) == (reasoning, content)


@pytest.mark.parametrize("text", ["Paris.", "\n\nParis.\n", "I think </think> is a tag.", "Say <think> x </think>",
                                  "<thin", ""])
def test_qwen3_without_a_block_is_all_content(text):
    """With `enable_thinking: false` the template closes an empty block in the prompt: no block in the output."""
    assert assert_stream_is_whole("qwen3", text, opens_reasoning(QWEN3_NO_THINKING)) == ("", text)


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
def test_a_block_the_prompt_opened_runs_to_its_end_or_the_end_of_the_output(name):
    opened = opens_reasoning(QWEN3_THINKING_ONLY if name == "qwen3" else DEEPSEEK_R1)
    text = "Okay, the user wants the capital.\nIt is Paris.\n</think>\n\nThe capital is Paris."
    expected = ("Okay, the user wants the capital.\nIt is Paris.", "The capital is Paris.")
    assert assert_stream_is_whole(name, text, opened) == expected
    assert assert_stream_is_whole(name, "<think>\n" + text, opened) == expected  # written again: dropped
    cut_off = "Okay, the user wants the capital.\nLet me think about </thi"
    assert assert_stream_is_whole(name, cut_off, opened) == (cut_off, "")


def test_deepseek_r1_assumes_its_template_opened_the_block_and_qwen3_does_not():
    text = "Hmm, 2 + 2.\n</think>\n\n4"
    assert reasoning_parser("deepseek_r1").parse(text) == ("Hmm, 2 + 2.", "4")
    assert reasoning_parser("qwen3").parse(text) == ("", text)
    assert reasoning_parser("deepseek_r1").parse("<think>\nHmm.\n</think>\n\n4", prompt_opened=False) == ("Hmm.", "4")


TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                  '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@pytest.mark.parametrize("reasoning,tools,prompt,text,expected", [
    ("qwen3", "hermes", QWEN3, qwen3_turn(f"Maybe {TOOL_CALL} is what I need.", "Let me check.\n" + TOOL_CALL),
     (f"Maybe {TOOL_CALL} is what I need.", "Let me check.", ["get_weather"])),
    ("qwen3", "hermes", QWEN3_THINKING_ONLY, f"I should call it.\n</think>\n\n{TOOL_CALL}\n{TOOL_CALL}",
     ("I should call it.", "", ["get_weather", "get_weather"])),
    ("qwen3", "hermes", QWEN3_THINKING_ONLY, f"Thinking {TOOL_CALL} never closed",
     (f"Thinking {TOOL_CALL} never closed", "", [])),
    ("qwen3", "hermes", QWEN3_NO_THINKING, f"Sure.\n{TOOL_CALL}", ("", "Sure.", ["get_weather"])),
    ("deepseek_r1", "deepseek_v3", DEEPSEEK_R1, f"Need the weather.\n</think>\n\n{DEEPSEEK_CALLS}",
     ("Need the weather.", "", ["get_weather"])),
    ("deepseek_r1", None, DEEPSEEK_R1, f"Need the weather.\n</think>\n\n{DEEPSEEK_CALLS}",
     ("Need the weather.", DEEPSEEK_CALLS, [])),
    (None, "hermes", QWEN3, qwen3_turn("Hmm.", TOOL_CALL), ("", "<think>\nHmm.\n</think>", ["get_weather"])),
], ids=["call-in-thought", "prompt-opened", "never-closed", "no-thinking", "deepseek", "no-tool-parser",
        "no-reasoning-parser"])
def test_calls_are_read_after_the_reasoning_streamed_as_whole(reasoning, tools, prompt, text, expected):
    parser = output_parser(reasoning, tools)
    whole = parser.parse(text, opens_reasoning(prompt), numbered_ids())
    assert (whole.reasoning, whole.content, [c.name for c in whole.calls]) == expected
    flat = (whole.reasoning, whole.content, [(c.id, c.name, c.arguments) for c in whole.calls])
    for pieces in cuts(text, random_cuts=10):
        stream = parser.stream(opens_reasoning(prompt), numbered_ids())
        outs = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert stream.reasoning_done == (reasoning is None or "</think>" in text or not opens_reasoning(prompt))
        got = ("".join(o.reasoning for o in outs), "".join(o.content for o in outs),
               joined_calls([d for o in outs for d in o.tool_calls]))
        assert got == flat, pieces


@pytest.mark.parametrize("option,name,call", [("--reasoning-parser", "deepseek", lambda n: output_parser(n, None)),
                                               ("--tool-call-parser", "qwen", lambda n: output_parser(None, n))])
def test_an_unknown_parser_is_refused_naming_the_option_and_the_names(option, name, call):
    with pytest.raises(ConfigError, match=f"{option} '{name}' is invalid: one of "):
        call(name)
    with pytest.raises(ConfigError, match="--reasoning-parser 'r1' is invalid: one of deepseek_r1, qwen3"):
        reasoning_parser("r1")
