"""The `deepseek_v3` tool-call format: DeepSeek-V3 (and R1, and the R1 distillations, whose templates
render calls the same way). The template writes an assistant turn's calls as one group,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(without the line break after the group's marker: it is shown here to read), the content, if any,
right before it. A group opens when its marker is followed by a whole call; each call in it is sent
as soon as its end marker has come; the group ends at its end marker, or where something other than
a call follows a call (that and the rest are then content, up to another group). A group marker not
followed by a call is content. Whitespace is allowed around the fence and the JSON.
"""

from __future__ import annotations

from tessera.infer.agents.json_scan import ScanSlot
from tessera.infer.agents.text_reader import WAIT, Reader
from tessera.infer.agents.tool_calls import arguments_text
from tessera.infer.agents.tool_stream import CallLayout, Calls, Content, MarkedFormat

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
LAYOUT = CallLayout(CALLS_BEGIN, CALL_BEGIN + "function" + SEP + "{name}\n```json\n", "\n```" + CALL_END, "\n",
                    CALLS_END)


class DeepSeekV3Format(MarkedFormat):
    MARKER = CALLS_BEGIN

    def __init__(self, slot: ScanSlot) -> None:
        super().__init__(slot)
        self._in_group = False

    def step(self, text: str, pos: int, final: bool) -> Content | Calls | None:
        if self._in_group:
            return self._group_step(text, pos, final)
        step = super().step(text, pos, final)
        self._in_group = isinstance(step, Calls)
        return step

    def _group_step(self, text: str, pos: int, final: bool) -> Content | Calls | None:
        r = Reader(text, pos, final, self._slot)
        if r.space() and r.literal(CALLS_END):
            self._in_group = False
            return Calls(r.pos, [])
        end_cut = r.cut
        step = self.read_call(text, pos, final)
        if isinstance(step, Calls):
            return step
        if (step is WAIT or end_cut) and not final:
            return None
        self._in_group = False  # not a call: the rest is read as text
        return self.step(text, pos, final)

    def read_call(self, text: str, pos: int, final: bool) -> Calls | bool | None:
        r = Reader(text, pos, final, self._slot)
        name = r.space() and r.literal(CALL_BEGIN) and r.literal("function" + SEP) and r.name()
        scan = name and r.space() and r.literal("```json") and r.space() and r.json()
        arguments = scan and arguments_text(text, scan.start, scan.end)
        if arguments and r.space() and r.literal("```") and r.space() and r.literal(CALL_END):
            return Calls(r.pos, [(name, arguments)])
        return r.outcome()
