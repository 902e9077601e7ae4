"""The `mistral` tool-call format, in both forms Mistral's chat templates render.

The v3 tokenizer's models (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct) write one JSON list:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]

and the v11 and later tokenizers' (Mistral Small 3.2, Magistral, Devstral, Ministral 3) one marker a call:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(Mistral Small 3.1's template writes `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, read too). An `id`
the model writes is not kept: the calls get fresh ids, nine letters and digits, the only ids the
templates take back. After `[TOOL_CALLS]`, a list none of whose elements fails to be a call, or a
name then `[ARGS]` and a JSON object, is read as calls; anything else leaves the marker as content.
The marker is a special token: the detokenizer must keep it in the text.
"""

from __future__ import annotations

from tessera.infer.agents.json_scan import COMPLETE, JsonScan
from tessera.infer.agents.text_reader import NOT_CALL, Reader
from tessera.infer.agents.tool_calls import arguments_text, object_call
from tessera.infer.agents.tool_stream import CallLayout, Calls, MarkedFormat

MARKER = "[TOOL_CALLS]"
ARGUMENT_KEYS = ("arguments", "parameters")
LAYOUT = CallLayout("", MARKER + "{name}[ARGS]", "", "", "")  # v11 and later
LIST_LAYOUT = CallLayout(MARKER + " [", '{"name": "{name}", "arguments": ', "}", ", ", "]")  # v3


class MistralFormat(MarkedFormat):
    MARKER = MARKER

    def read_call(self, text: str, pos: int, final: bool) -> Calls | bool | None:
        r = Reader(text, pos, final, self._slot)
        r.space()
        if text.startswith("[", r.pos):
            return self._list(r)
        name = r.name()
        if not name:
            return r.outcome()
        if r.literal("[CALL_ID]"):
            if not r.name():
                return r.outcome()
        elif r.cut:
            return r.outcome()
        scan = r.literal("[ARGS]") and r.space() and r.json()
        arguments = scan and arguments_text(text, scan.start, scan.end)
        return Calls(r.pos, [(name, arguments)]) if arguments else r.outcome()

    def _list(self, r: Reader) -> Calls | bool | None:
        scan = r.json("[")
        if scan is None:
            return r.outcome()
        calls = [_element_call(r.text, start) for _, start, _ in scan.children]
        if not calls or None in calls:
            return NOT_CALL
        return Calls(r.pos, calls)


def _element_call(text: str, start: int) -> tuple[str, str] | None:
    if text[start] != "{":
        return None
    scan = JsonScan(start)
    return object_call(text, scan, ARGUMENT_KEYS) if scan.advance(text) == COMPLETE else None
