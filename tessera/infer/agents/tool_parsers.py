"""The tool-call parsers by the names `--tool-call-parser` takes (vLLM's spellings): `hermes`,
`llama3_json`, `mistral`, `deepseek_v3`.

    parser = tool_call_parser("hermes")
    content, calls = parser.parse(text)              # a whole output
    stream = parser.stream()                         # or one output as it is generated:
    for delta in deltas:
        out = stream.feed(delta)                     # out.content, out.tool_calls
    out = stream.finish()

A new format is a module with a reader (`CallFormat`: `step(text, pos, final)`, tool_stream.py) and
its `CallLayout`, and a line here.
"""

from __future__ import annotations

from tessera.config.errors import ConfigError, require
from tessera.infer.agents import deepseek_v3, hermes, llama3_json, mistral
from tessera.infer.agents.tool_calls import mistral_call_id, openai_call_id
from tessera.infer.agents.tool_stream import ToolCallParser

TOOL_CALL_PARSERS = {p.name: p for p in (
    ToolCallParser("hermes", hermes.HermesFormat, openai_call_id, hermes.LAYOUT),
    ToolCallParser("llama3_json", llama3_json.Llama3JsonFormat, openai_call_id, llama3_json.LAYOUT),
    ToolCallParser("mistral", mistral.MistralFormat, mistral_call_id, mistral.LAYOUT),
    ToolCallParser("deepseek_v3", deepseek_v3.DeepSeekV3Format, openai_call_id, deepseek_v3.LAYOUT),
)}


def tool_call_parser(name: str, error: type[ConfigError] = ConfigError) -> ToolCallParser:
    """The parser named `name`; `error` (a ConfigError by default, as for a flag) names the option
    and the names there are."""
    require(name in TOOL_CALL_PARSERS, "--tool-call-parser", name, f"one of {', '.join(TOOL_CALL_PARSERS)}",
            error, sep=" ")
    return TOOL_CALL_PARSERS[name]
