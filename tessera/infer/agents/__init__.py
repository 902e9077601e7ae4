"""What an agent's model writes besides its answer, read out of the generated text: tool calls in each
family's format and the reasoning of `<think>` models, whole or delta by delta as a stream, the streamed
result always equal to the whole one; and the agent turn built on them. The parsers are pure text, no
torch: the server maps the results onto its APIs.

- `tool_parsers.py`: the `--tool-call-parser` registry (`tool_call_parser(name)`), one module a format
  (`hermes.py`, `llama3_json.py`, `mistral.py`, `deepseek_v3.py`) over one stream (`tool_stream.py`)
  and the calls it hands back (`tool_calls.py`);
- `reasoning.py`: the `--reasoning-parser` registry (`deepseek_r1`, `qwen3`) and its stream;
- `output_parser.py`: reasoning first, then tool calls in the text after it, whole or streamed;
- `json_scan.py`, `text_reader.py`: reading JSON and markers in text that is still growing.

The agent turn, the layer every agent API (Chat Completions, Responses, Messages) is built on and
which names no API's fields: `turn.py` (an `AgentTurn`: the conversation, tools, tool choice, checked
alike for every API), `turn_plan.py` (`AgentTurns.prepare(turn)` -> a `TurnPlan`: the chat template's
prompt, the constraint on the calls, the reader of the output; its docstring says how a protocol
module uses it), `turn_output.py` (what the turn produced, whole or delta by delta),
`tool_grammar.py` (the grammar that makes calls valid, in the model's own format) and `options.py`
(`--tool-call-parser`, `--enable-auto-tool-choice`, `--reasoning-parser`).
"""
