"""The `llama3_json` tool-call format: Llama 3.1, 3.2 and 3.3 calling the functions a request offers.

Their chat template renders a call as the whole assistant turn,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

and the models write it so, sometimes after `<|python_tag|>`. The format has no end marker and no
marker before plain text, so calls are read only where the output starts (after whitespace and an
optional `<|python_tag|>`): a JSON object with a `name` and its `parameters` (`arguments` is read too)
is a call, and more calls may follow, each after `;` (the template renders one call a turn; vLLM's
parser reads `;`-separated ones, and so does this one). An output that starts otherwise is all
content, and so is whatever follows the calls that is not another call (`;` included). Llama's
built-in tools (`<|python_tag|>brave_search.call(...)`) are not JSON and stay content.
"""

from __future__ import annotations

from tessera.infer.agents.json_scan import ScanSlot
from tessera.infer.agents.text_reader import WAIT, Reader
from tessera.infer.agents.tool_calls import object_call
from tessera.infer.agents.tool_stream import CallLayout, Calls, Content

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
ARGUMENT_KEYS = ("parameters", "arguments")
LAYOUT = CallLayout("", '{"name": "{name}", "parameters": ', "}", SEPARATOR + " ", "")


class Llama3JsonFormat:
    def __init__(self, slot: ScanSlot) -> None:
        self._slot = slot
        self._state = "start"  # start: nothing decided yet; calls: after a call; content: the rest is text

    def step(self, text: str, pos: int, final: bool) -> Content | Calls | None:
        if self._state == "content":
            return Content(len(text))
        r = Reader(text, pos, final, self._slot)
        r.space()
        opened = r.literal(SEPARATOR) if self._state == "calls" else r.literal(PYTHON_TAG) or not r.cut
        scan = opened and r.space() and r.json()
        call = scan and object_call(text, scan, ARGUMENT_KEYS)
        if call:
            self._state = "calls"
            return Calls(r.pos, [call])
        if r.outcome() is WAIT:
            return None
        self._state = "content"
        return Content(len(text))
