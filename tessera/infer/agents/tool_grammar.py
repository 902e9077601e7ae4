"""The grammar (llguidance's Lark syntax) that makes a model's tool calls valid: written in the model's
own format, naming an offered function, with arguments that validate against that function's schema.

A call format's `CallLayout` (tool_stream.py) says how its template writes calls: `prefix`, then each
call as `before` (with the function's name) + its arguments + `after`, joined by `separator`, then
`suffix`. The grammar is that, with each function's arguments its JSON schema (`%json`, compact as
`response_format`'s: ", " and ": ", which is also how templates `tojson` arguments):

- `required` / a named function: the output is the calls and nothing else (one call with
  `parallel=False` or a named function; one or more otherwise);
- `auto` with a `strict` tool: the model may answer in text, but text that reaches the format's
  marker (`<tool_call>`, `[TOOL_CALLS]`, ...) goes on as calls; a format without a marker
  (`llama3_json`, whose calls open the output) allows text that does not open with `{`, or calls.

Ahead of that, with a reasoning parser on, the `<think>` block: already opened by the prompt
(`reasoning="opened"`: any text up to `</think>`), or optional (`"optional"`: the model may open one).
Literal text that contains one of the tokenizer's added tokens names it as a token (`<[id]>`): the
model writes `<tool_call>` (Qwen), `[TOOL_CALLS]` and `[ARGS]` (Mistral), `</think>` as one token,
and llguidance reads every added token, special or not, as a special token that no text matches (so
the tokenizer, which encodes the text `<tool_call>` as that token, and the grammar engine agree).
Text outside the calls never holds the format's marker, even spelled out in other tokens, so that
every call the parser reads was constrained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from tessera.infer.agents.reasoning import END, START
from tessera.infer.agents.tool_stream import CallLayout

# as structured_output.JSON_OPTIONS: the compact JSON the server's constrained output writes
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")


def literal(text: str, tokens: Mapping[str, int]) -> str:
    """`text` as Lark items: quoted strings, and `<[id]>` where an added token's text stands (the
    leftmost first, the longest of those starting there)."""
    items, rest = [], text
    while rest:
        hits = [(rest.find(t), -len(t), t) for t in tokens if t and t in rest]
        if not hits:
            items.append(json.dumps(rest, ensure_ascii=False))
            break
        at, _, token = min(hits)
        if at:
            items.append(json.dumps(rest[:at], ensure_ascii=False))
        items.append(f"<[{tokens[token]}]>")
        rest = rest[at + len(token):]
    return " ".join(items)


def _regex_text(text: str) -> str:
    """`text` matched literally inside a Lark `/.../` regex."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _seq(*items: str) -> str:
    """Lark items in sequence, the empty ones left out."""
    return " ".join(i for i in items if i)


def _schema(parameters: Mapping) -> str:
    options = {**_JSON_OPTIONS, **dict(parameters.get("x-guidance") or {})}
    return json.dumps({**dict(parameters), "x-guidance": options}, ensure_ascii=False)


def tool_grammar(layout: CallLayout, tools: Sequence[tuple[str, Mapping]], *, parallel: bool, auto: bool = False,
                 marker: str | None = None, reasoning: str | None = None,
                 tokens: Mapping[str, int] | None = None) -> str:
    """The grammar of calls of `tools` (`(name, parameters schema)` each) in `layout`: calls only, or
    with `auto` text or calls (`marker`: where the format's calls open; None: at the output's start);
    `reasoning` None, "opened" or "optional" (the `<think>` block before); `tokens`: the tokenizer's
    added tokens, text -> id."""
    tokens = dict(tokens or {})
    lines = ["%llguidance {}"]
    lines += [f"c{i}: " + _seq(literal(layout.before.replace("{name}", name), tokens), f"a{i}",
                               literal(layout.after, tokens)) for i, (name, _) in enumerate(tools)]
    lines += [f"a{i}: %json {_schema(schema)}" for i, (_, schema) in enumerate(tools)]
    lines.append("call: " + " | ".join(f"c{i}" for i in range(len(tools))))
    separator = literal(layout.separator, tokens)
    more = f"({separator} call)*" if separator else "call*"
    lines.append(f"calls: call {more}" if parallel else "calls: call")
    ends = [literal(layout.prefix, tokens), "calls", literal(layout.suffix, tokens)]
    lines.append("body: " + _seq(*ends))
    lines += _auto_lines(layout, tools, parallel, marker, tokens) if auto else ["answer: body"]
    lines += _reasoning_lines(reasoning, tokens, gap=not auto)
    return "\n".join(lines) + "\n"


def _auto_lines(layout: CallLayout, tools: Sequence[tuple[str, Mapping]], parallel: bool, marker: str | None,
                tokens: Mapping[str, int]) -> list[str]:
    """`answer`: text or calls. Text that reaches `marker` goes on as the rest of the calls (the
    layout's opening less the marker); without a marker, text may not open as a call does."""
    if marker is None:
        opening = (layout.prefix + layout.before)[:1] or "{"
        return [f"FREE: /(?s:.*)/ & ~/[ \\t\\n]*{_regex_text(opening)}(?s:.*)/", "answer: FREE | body"]
    opened = layout.prefix + layout.before
    if not opened.startswith(marker):
        raise ValueError(f"the layout does not open with its marker {marker!r}")
    if layout.prefix:
        rest = [literal(layout.prefix[len(marker):], tokens), "calls", literal(layout.suffix, tokens)]
        first = []
    else:  # the marker opens the first call's `before`: its rest, then the other calls
        first = [f"f{i}: " + _seq(literal(layout.before[len(marker):].replace("{name}", name), tokens), f"a{i}",
                                  literal(layout.after, tokens)) for i, (name, _) in enumerate(tools)]
        first.append("first: " + " | ".join(f"f{i}" for i in range(len(tools))))
        separator = literal(layout.separator, tokens)
        more = (f"({separator} call)*" if separator else "call*") if parallel else ""
        rest = ["first", more, literal(layout.suffix, tokens)]
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*){_regex_text(marker)}(?s:.*)/"  # the marker not even spelled out
    if marker in tokens:  # text never holds an added token: it ends where the marker's token comes
        lead = [f"lead: FREE <[{tokens[marker]}]>", free]
    else:
        lead = [f"lead[lazy]: /(?s:.*){_regex_text(marker)}/", free]
    return first + lead + ["answer: FREE | " + _seq("lead", *rest)]


def _reasoning_lines(reasoning: str | None, tokens: Mapping[str, int], gap: bool) -> list[str]:
    """`start`: the answer, after the `<think>` block when there is one."""
    if reasoning is None:
        return ["start: answer"]
    if END in tokens:
        think = [f"think: THOUGHT <[{tokens[END]}]>", f"THOUGHT: /(?s:.*)/ & ~/(?s:.*){_regex_text(END)}(?s:.*)/"]
    else:
        think = [f"think[lazy]: /(?s:.*){_regex_text(END)}/"]
    after = ' "\\n\\n"? answer' if gap else " answer"
    if reasoning == "opened":
        return think + ["start: think" + after]
    return think + [f"start: ({literal(START, tokens)} think)?" + after]
