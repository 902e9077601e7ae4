"""Tool-call parsers (tessera/infer/agents): for each of `hermes`, `llama3_json`, `mistral` and
`deepseek_v3`, the exact text the family's published chat template renders for an assistant turn's
calls (Qwen2.5, Qwen3; Llama 3.1; Mistral v0.3, Nemo, Small 3.1, v11+; DeepSeek-V3 / R1) parses to
those calls and the content before them: one call, parallel calls, nested objects, unicode, and the
format's end marker inside a JSON string; arguments are the model's JSON text verbatim. The stream,
fed the text cut at every position, one character at a time and at random multi-cuts, gives exactly
the whole parse (content, ids, names, arguments) in OpenAI's delta shape. Text that only looks like a
call (a marker in prose, a call cut off or malformed) stays content, never raises, also on random
texts built from the formats' pieces. Each format's layout parses back; ids have each family's shape;
an unknown parser name is refused naming the option and the names."""

from __future__ import annotations

import json
import random
import re

import pytest

from tessera.config.errors import ConfigError
from tessera.infer.agents import mistral
from tessera.infer.agents.json_scan import COMPLETE, PARTIAL, JsonScan
from tessera.infer.agents.tool_parsers import TOOL_CALL_PARSERS, tool_call_parser
from tests.infer.agent_streams import cuts, joined_calls, numbered_ids


def tojson(value) -> str:
    """The templates' `tojson` as transformers defines it (no ASCII escapes, keys in order)."""
    return json.dumps(value, ensure_ascii=False)


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
EMPTY = ("get_time", {})
NESTED = ("create_event", {"title": "Réunion", "when": {"date": "2025-03-01", "slots": [9, 10.5, -2e-3]},
                           "attendees": [{"name": "Zoë", "optional": False}], "notes": None})
UNICODE = ("translate", {"text": "東京の天気 ☀️ naïve\n\"quoted\"", "to": "en"})
MARKERS = ("echo", {"text": "</tool_call><tool_call> [TOOL_CALLS]x[ARGS]{ ; <｜tool▁call▁end｜>``` "
                            "<｜tool▁calls▁end｜> <|python_tag|> } ] \\"})
CALLS = {"single": [WEATHER], "parallel": [WEATHER, EMPTY, UNICODE], "nested": [NESTED], "unicode": [UNICODE],
         "end marker in a string": [MARKERS]}


# What each template renders for an assistant turn (content, then calls (name, arguments object)), less
# the generation prompt: the text the model was trained to write.
def qwen25(content, calls):
    turn = ("\n" + content if content else "") + "".join(
        '\n<tool_call>\n{"name": "' + name + '", "arguments": ' + tojson(args) + "}\n</tool_call>"
        for name, args in calls)
    return turn[1:]  # the generation prompt `<|im_start|>assistant\n` holds the first newline


def qwen3(content, calls):
    out = content
    for i, (name, args) in enumerate(calls):
        out += ("\n" if (i == 0 and content) or i > 0 else "")
        out += '<tool_call>\n{"name": "' + name + '", "arguments": ' + tojson(args) + "}\n</tool_call>"
    return out


def llama31(content, calls):
    (name, args), = calls  # the template raises on more than one call a turn, and writes no content
    return '{"name": "' + name + '", ' + '"parameters": ' + tojson(args) + "}"


def mistral_v03(content, calls, opening="[TOOL_CALLS] ["):
    ids = [f"a{i}B2c3D4e" for i in range(len(calls))]
    return opening + ", ".join(tojson({"name": name, "arguments": args})[:-1] + ', "id": "' + i + '"}'
                               for (name, args), i in zip(calls, ids)) + "]"


def mistral_nemo(content, calls):
    return mistral_v03(content, calls, opening="[TOOL_CALLS][")


def mistral_v11(content, calls):
    return content + "".join("[TOOL_CALLS]" + name + "[ARGS]" + tojson(args) for name, args in calls)


def mistral_small31(content, calls):
    return content + "".join(f"[TOOL_CALLS]{name}[CALL_ID]a{i}B2c3D4e[ARGS]{tojson(args)}"
                             for i, (name, args) in enumerate(calls))


def deepseek_v3(content, calls):
    blocks = ["<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name + "\n```json\n" + tojson(args)
              + "\n```<｜tool▁call▁end｜>" for name, args in calls]
    return content + "<｜tool▁calls▁begin｜>" + "\n".join(blocks) + "<｜tool▁calls▁end｜>"


TEMPLATES = {"hermes": [qwen25, qwen3], "llama3_json": [llama31],
             "mistral": [mistral_v03, mistral_nemo, mistral_v11, mistral_small31], "deepseek_v3": [deepseek_v3]}
PARALLEL_FREE = {llama31}  # one call a turn
CONTENT_FREE = {llama31, mistral_v03, mistral_nemo, mistral_small31}  # a turn with calls renders no content
TEMPLATE_CASES = [(parser, template, case) for parser, templates in TEMPLATES.items() for template in templates
                  for case in CALLS if template not in PARALLEL_FREE or len(CALLS[case]) == 1]


def streamed(parser, pieces, ids):
    stream = parser.stream(ids)
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(o.content for o in outs)
    calls = joined_calls([d for o in outs for d in o.tool_calls])
    assert content == stream.content and calls == [(c.id, c.name, c.arguments) for c in stream.calls]
    return content, calls


def assert_stream_is_whole(name: str, text: str, random_cuts: int = 20, every_position: bool = True):
    parser = tool_call_parser(name)
    whole = parser.parse(text, numbered_ids())
    expected = (whole.content, [(c.id, c.name, c.arguments) for c in whole.calls])
    for pieces in cuts(text, random_cuts=random_cuts, every_position=every_position):
        assert streamed(parser, pieces, numbered_ids()) == expected, pieces
    return whole


@pytest.mark.parametrize("parser,template,case", TEMPLATE_CASES,
                         ids=[f"{p}-{t.__name__}-{c}" for p, t, c in TEMPLATE_CASES])
def test_each_template_renders_calls_the_parser_reads(parser, template, case):
    calls = CALLS[case]
    for content in ([""] if template in CONTENT_FREE else ["", "Let me look that up."]):
        text = template(content, calls)
        whole = assert_stream_is_whole(parser, text)
        assert whole.content == content
        assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
        assert [c.arguments for c in whole.calls] == [tojson(args) for _, args in calls]  # verbatim


def test_arguments_the_template_wrote_as_a_json_string_are_that_string():
    """Mistral's templates `tojson` the function as the request holds it, so OpenAI's string arguments
    come out quoted; Qwen3's writes a string as it is. Either way the call's arguments are the object's text."""
    quoted = '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}", "id": "a0B2c3D4e"}]'
    (call,) = assert_stream_is_whole("mistral", quoted).calls
    assert call.arguments == '{"city": "Paris"}'
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","n":1.50}}\n</tool_call>'
    (call,) = assert_stream_is_whole("hermes", raw).calls
    assert call.arguments == '{"city":"Paris","n":1.50}'  # spacing and number as written


def test_whitespace_around_calls_is_not_content_and_text_after_them_is():
    parser = tool_call_parser("hermes")
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parser.parse(f"  Hi there \n\n{call}\n\n{call}\n").content == "  Hi there"
    assert parser.parse(f"{call}\nDone.\n").content == "Done.\n"
    assert parser.parse(f"Checking.\n{call}\n{call}\nDone.").content == "Checking.\nDone."
    assert parser.parse("No calls, trailing space \n").content == "No calls, trailing space \n"
    for text in (f"  Hi there \n\n{call}\n\n{call}\n", f"{call}\nDone.\n", f"a {call} b", f"a\n{call}\n{call} b "):
        assert_stream_is_whole("hermes", text)


LOOKALIKES = {
    "hermes": ["Wrap each call in <tool_call> tags, like <tool_call>this</tool_call>.",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no end marker
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # unbalanced
               '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
               '<tool_call>\n{"name": "get weather", "arguments": {}}\n</tool_call>',  # not a function name
               '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
               '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',
               '<tool_call>\n{"name": "f", "arguments": {}} and more\n</tool_call>',
               '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
               '<tool_call>\n{"name": "f", "arguments": {"x": "a\tb"}}\n</tool_call>',  # raw control character
               '<tool_call>\n["f", {}]\n</tool_call>', "<tool_call", "<tool_call>", "</tool_call>"],
    "llama3_json": ['Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"answer": 42, "parameters": {}}', '{"name": "get_weather", "parameters": {"city": "Paris"}',
                    '<|python_tag|>brave_search.call(query="weather in Paris")', "<|python_tag|", "{", "[1, 2]",
                    '{"name": "f", "parameters": {} '],
    "mistral": ["Use [TOOL_CALLS] to call.", "[TOOL_CALLS]", "[TOOL_CALLS] []",
                '[TOOL_CALLS] [{"name": "f", "arguments": {}}', '[TOOL_CALLS] [{"name": "f", "arguments": {}}, 3]',
                "[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather[ARGS]", '[TOOL_CALLS]get weather[ARGS]{"a": 1}',
                '[TOOL_CALLS]f[ARGS]{"a": 1', "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[CALL_ID][ARGS]{}",
                "[TOOL_CALLS]f[ARG]{}"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜>I will not call anything.",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{bad}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>",
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>"],
}
LOOKALIKE_CASES = [(parser, text) for parser, texts in LOOKALIKES.items() for text in texts]


@pytest.mark.parametrize("parser,text", LOOKALIKE_CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(LOOKALIKE_CASES)])
def test_text_that_only_looks_like_a_call_is_content(parser, text):
    whole = assert_stream_is_whole(parser, text)
    assert whole == (text, [])


@pytest.mark.parametrize("parser,text,content,names", [
    ("hermes", '<tool_call>{bad}</tool_call> then <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     "<tool_call>{bad}</tool_call> then", ["f"]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": [1]}} ;{"oops": 1}',
     ';{"oops": 1}', ["f", "g"]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; and prose', "; and prose", ["f"]),
    ("mistral", 'Hi [TOOL_CALLS]nope [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{} bye',
     "Hi [TOOL_CALLS]nope bye", ["f", "g"]),  # the whitespace before the calls keeps the two apart
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
     "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{oops\n```<｜tool▁call▁end｜>",
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{oops\n```<｜tool▁call▁end｜>", ["f"]),
])
def test_a_malformed_call_is_content_and_the_good_calls_around_it_are_calls(parser, text, content, names):
    whole = assert_stream_is_whole(parser, text)
    assert whole.content == content and [c.name for c in whole.calls] == names


PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "f", "arguments": {"a": 1}}',
               '{"name": "g", "arguments": {"s": "</tool_call>"}}', '{"name": "h"}', "{", "}", '"', "text", "\\"],
    "llama3_json": ["<|python_tag|>", ";", " ", '{"name": "f", "parameters": {"a": 1}}',
                    '{"name": "g", "parameters": {}}', "{", "}", '"', "text", "<|python"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "abc123XYZ", "f", " ", "[", "]", '{"a": 1}', "{", "}",
                '{"name": "f", "arguments": {"b": 2}}', ",", "text"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "function<｜tool▁sep｜>", "f", "\n```json\n", "\n```", '{"a": "```"}', "{", "\n", "text"],
}


@pytest.mark.parametrize("name", list(PIECES))
def test_random_texts_of_the_formats_pieces_never_raise_and_stream_as_they_parse(name):
    rng = random.Random(name)
    for _ in range(60):
        text = "".join(rng.choice(PIECES[name]) for _ in range(rng.randint(1, 14)))
        whole = assert_stream_is_whole(name, text, random_cuts=5)
        for call in whole.calls:
            assert isinstance(json.loads(call.arguments), dict)


def _random_arguments(rng: random.Random, depth: int = 0):
    keys = ["city", "q", "名前", "a b", "</tool_call>", "[ARGS]", "```"]
    values = [lambda: rng.randint(-10**12, 10**12), lambda: rng.random() * 1e6, lambda: rng.choice([True, None]),
              lambda: rng.choice(["", "東京 ☀️", "x\ny", '"', "\\", "<｜tool▁call▁end｜>", "}"])]
    if depth < 2:
        values += [lambda: _random_arguments(rng, depth + 1), lambda: [values[1](), _random_arguments(rng, depth + 1)]]
    return {rng.choice(keys): rng.choice(values)() for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("name", list(TOOL_CALL_PARSERS))
def test_each_layout_renders_calls_its_parser_reads_back(name):
    """The layout is what a grammar constraining calls (tool_choice `required`) would have the model write."""
    parser, rng = tool_call_parser(name), random.Random(name)
    layouts = [parser.layout] + ([mistral.LIST_LAYOUT] if name == "mistral" else [])
    for layout in layouts:
        for _ in range(20):
            calls = [(rng.choice(["f", "get_weather", "ns.tool:v2", "a-b"]), tojson(_random_arguments(rng)))
                     for _ in range(rng.randint(1, 3))]
            whole = assert_stream_is_whole(name, layout.render(calls), random_cuts=10, every_position=False)
            assert whole.content == "" and [(c.name, c.arguments) for c in whole.calls] == calls


def _scanned(text: str, incrementally: bool) -> JsonScan:
    scan = JsonScan(0)
    for k in range(1, len(text) + 1) if incrementally else [len(text)]:
        if scan.advance(text[:k]) != PARTIAL:
            break
    return scan


def test_the_json_scanner_agrees_with_json_loads_on_every_prefix():
    """Every proper prefix of a JSON document is PARTIAL, the document COMPLETE where it ends, its
    members' spans hold their values; on a document with one character changed, the scanner fed
    piece by piece decides as when fed at once, COMPLETE at the end exactly when json.loads reads it."""
    rng = random.Random(0)
    for _ in range(150):
        value = {"k": _random_arguments(rng), "s": rng.choice(["a\tb", "\\u12", "x"])}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        assert all(JsonScan(0).advance(text[:k]) == PARTIAL for k in range(len(text)))
        scan = _scanned(text + " tail", incrementally=False)
        assert scan.status == COMPLETE and scan.end == len(text)
        assert {key: json.loads(text[a:b]) for key, (a, b) in scan.members().items()} == value
        at = rng.randrange(len(text))
        changed = text[:at] + rng.choice(['"', ",", "}", "]", ":", "0", "\\", "\t", "\x01", "x"]) + text[at + 1:]
        piecewise, whole = _scanned(changed, incrementally=True), _scanned(changed, incrementally=False)
        assert (piecewise.status, piecewise.end) == (whole.status, whole.end)
        try:
            readable = isinstance(json.loads(changed), dict | list)
        except ValueError:
            readable = False
        assert readable == (whole.status == COMPLETE and whole.end == len(changed)), changed


def test_call_ids_are_unique_and_shaped_as_each_family_takes_them_back():
    for name, shape in [("hermes", r"call_[0-9a-f]{24}"), ("llama3_json", r"call_[0-9a-f]{24}"),
                        ("mistral", r"[A-Za-z0-9]{9}"), ("deepseek_v3", r"call_[0-9a-f]{24}")]:
        parser = tool_call_parser(name)
        text = parser.layout.render([("f", "{}")] * 5)
        ids = [c.id for c in parser.parse(text).calls] + [c.id for c in parser.parse(text).calls]
        assert len(set(ids)) == 10 and all(re.fullmatch(shape, i) for i in ids), ids


def test_a_long_argument_streamed_in_small_deltas_parses_in_one_pass():
    """A 200 kB argument fed 4 characters at a time (the JSON being read resumes where it stopped)."""
    args = tojson({"code": "print('x')\n" * 18000, "list": list(range(3000))})
    text = "Writing.\n" + qwen3("", [("write_file", json.loads(args))])
    stream = tool_call_parser("hermes").stream(numbered_ids())
    for i in range(0, len(text), 4):
        stream.feed(text[i:i + 4])
    stream.finish()
    assert stream.content == "Writing." and [c.arguments for c in stream.calls] == [args]


def test_an_unknown_parser_is_refused_naming_the_option_and_the_names():
    with pytest.raises(ConfigError, match=r"--tool-call-parser 'pythonic' is invalid: one of hermes, "
                                          r"llama3_json, mistral, deepseek_v3"):
        tool_call_parser("pythonic")
