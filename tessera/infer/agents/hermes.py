"""The `hermes` tool-call format: Hermes 2 Pro / 3, Qwen2.5 and Qwen3 (their chat templates render an
assistant turn's calls so, and their models write them so).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, parallel calls one after another (Qwen3's template puts a newline between two
blocks, and between the content and the first; Qwen2.5's a newline before each block). A block is a
call when `<tool_call>` is followed by a JSON object with a `name` and its `arguments` (an object;
`parameters` is read too), then `</tool_call>`, whitespace allowed around the object; the end marker
inside one of the object's strings is part of the string. Anything else after `<tool_call>` (prose
that mentions the tag, a block cut off or malformed) leaves the marker and what follows as content.
"""

from __future__ import annotations

from tessera.infer.agents.text_reader import Reader
from tessera.infer.agents.tool_calls import object_call
from tessera.infer.agents.tool_stream import CallLayout, Calls, MarkedFormat

START, END = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
# Qwen3's template, for an assistant turn with no content: blocks joined by a newline
LAYOUT = CallLayout("", START + '\n{"name": "{name}", "arguments": ', "}\n" + END, "\n", "")


class HermesFormat(MarkedFormat):
    MARKER = START

    def read_call(self, text: str, pos: int, final: bool) -> Calls | bool | None:
        r = Reader(text, pos, final, self._slot)
        scan = r.space() and r.json()
        call = scan and object_call(text, scan, ARGUMENT_KEYS)
        if call and r.space() and r.literal(END):
            return Calls(r.pos, [call])
        return r.outcome()
