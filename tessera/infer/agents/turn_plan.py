"""The layer every agent API is built on, whichever protocol it speaks: one `AgentTurn` (turn.py) in;
the prompt the model's chat template renders, the sampling parameters with the constraint on the
calls, and a reader of the output (turn_output.py) out. A protocol module (Chat Completions:
tessera/infer/api/openai_tools.py) only translates its own shapes, in and out, in three steps:

1. Render: build an `AgentTurn` from the request (`TurnMessage`s, `Tool`s, a `ToolChoice`,
   `parallel_tool_calls`, template variables; `spelling` and `TurnMessage.where` so that refusals
   name the request's own fields), then `plan = turns.prepare(turn)`, in a worker thread (schemas
   compile, the template renders). `plan.prompt` is the template's text, tools passed to it as
   transformers' `apply_chat_template(tools=...)` passes them; it is tokenised as any chat prompt.
2. Constrain: `params = plan.sampling(params)` adds the grammar of the turn's calls where they must
   be valid (below) and keeps special tokens in the text the parsers read; the engine then runs the
   request as any other.
3. Read: whole, `plan.output(out)` of the finished engine output is a `TurnOutput` (reasoning,
   content, tool calls, finish reason, reasoning tokens); streamed, `decoder = plan.decoder()` for
   each output and `decoder.step(out)` for each engine step give `TurnDelta`s (text to append to the
   reasoning and to the content, `ToolCallDelta`s: a call's index, id and name first, then its
   arguments in pieces; the finish reason last). The deltas put together are the whole output, so
   a protocol's streamed and whole answers agree. Finish "tool_calls": the model stopped after
   calling; "length": it ran out of tokens.

    turns = AgentTurns(options, tokenizer, chat_template)       # once, with the server
    plan = turns.prepare(turn)                                  # per request, in a worker thread
    plan.prompt                                                 # the chat template's text
    params = plan.sampling(params)                              # + the tool-call grammar, specials kept
    plan.decoder().step(out) / plan.output(out)                 # TurnDelta / TurnOutput

What a turn is asked to do with its tools, by its tool choice:

- `none`: the tools reach the template (the model knows them) but no call is read: all is content;
- `auto`: needs `--enable-auto-tool-choice` (refused otherwise, naming the tool choice, as vLLM does);
  the `--tool-call-parser` reads the calls the model writes; a `strict` tool constrains the calls
  (tool_grammar.py: text may not reach the format's marker without going on as a valid call);
- `required` (one or more calls; one where parallel calls are off) and `function` (one call of the
  function named): decoding is constrained to calls in the parser's format (hermes where none is
  set), each naming an offered function with arguments valid against its schema, and the same
  parser reads them out, so that even a random model's output is a valid call. Mistral's format is
  its v11 form (`[TOOL_CALLS]name[ARGS]{...}`) where `[ARGS]` is a token of the vocabulary, else the
  v3 list.

With a reasoning parser the calls are read (and constrained) after the `<think>` block. Whether the
prompt opened the block is read from the rendered prompt (`opens_reasoning`): opened, the output
reasons until `</think>`; closed by the prompt (Qwen3's `enable_thinking: false` writes an empty
block), a constrained output has no block; neither, the model may open one. While a parser reads
the output, special tokens stay in its text (`skip_special_tokens` off): Mistral's `[TOOL_CALLS]`
and Llama's `<|python_tag|>` are special tokens the detokenizer would drop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.config.errors import RequestError
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE
from tessera.infer.agents import mistral
from tessera.infer.agents.options import AgentOptions
from tessera.infer.agents.output_parser import OutputParser, output_parser
from tessera.infer.agents.reasoning import END, opens_reasoning
from tessera.infer.agents.tool_grammar import tool_grammar
from tessera.infer.agents.tool_parsers import tool_call_parser
from tessera.infer.agents.tool_stream import CallLayout, ToolCallParser
from tessera.infer.agents.turn import AgentTurn, Tool, refuse
from tessera.infer.agents.turn_output import Decode, EngineOutput, TurnDecoder, TurnOutput, whole_output
from tessera.infer.sampling.params import SamplingParams

CONSTRAINED_DEFAULT_PARSER = "hermes"  # the call format of constrained calls where no --tool-call-parser is set


@dataclass(frozen=True)
class TurnPlan:
    """One turn ready to run: its prompt, the grammar its output must follow (None: free), and how
    its output is read (`parser`; `opened`: the prompt opened the reasoning block)."""

    prompt: str
    parser: OutputParser
    opened: bool
    guided_grammar: str | None = None
    decode: Decode | None = None

    @property
    def reads_output(self) -> bool:
        """Whether anything is read out of the output (otherwise all of it is content)."""
        return self.parser.reasoning is not None or self.parser.tools is not None

    @property
    def reads_reasoning(self) -> bool:
        return self.parser.reasoning is not None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with the turn's constraint, keeping special tokens in the text a parser reads;
        RequestError naming `response_format` where one is set on a constrained turn."""
        if self.guided_grammar is not None and params.response_format is not None:
            raise refuse("response_format", "response_format", params.response_format,
                         "must be unset when tool calls are constrained (a required or named tool choice, "
                         "or a strict tool)")
        changes: dict = {}
        if self.guided_grammar is not None:
            changes["guided_grammar"] = self.guided_grammar
        if self.reads_output:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def decoder(self) -> TurnDecoder:
        """A reader of one output, step by step."""
        return TurnDecoder(self.parser, self.opened, self.decode)

    def output(self, out: EngineOutput) -> TurnOutput:
        """A finished output, read at once."""
        return whole_output(self.parser, out, self.opened, self.decode)


class AgentTurns:
    """The server's agent setup: its options (`--tool-call-parser`, ...), the tokenizer and the chat
    template (None: the tokenizer's own)."""

    def __init__(self, options: AgentOptions, tokenizer, chat_template: str | None = None):
        self.options, self.tokenizer, self.chat_template = options, tokenizer, chat_template
        self._reasoning = output_parser(options.reasoning_parser).reasoning if options.reasoning_parser else None
        added = tokenizer.backend.get_added_tokens_decoder() if tokenizer is not None else {}
        self.added = {t.content: i for i, t in added.items() if t.content}  # grammars name them as tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prepare(self, turn: AgentTurn) -> TurnPlan:
        """The plan of `turn`; RequestError naming the field a turn cannot be served for."""
        parser = self._tool_parser(turn)
        messages = turn.template_messages()
        if self.chat_template == PLAIN_CHAT_TEMPLATE:  # it concatenates contents: a turn of calls only has ""
            messages = [{**m, "content": m["content"] or ""} for m in messages]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    chat_template=self.chat_template, tools=turn.template_tools(),
                                                    **dict(turn.template_kwargs))
        opened = self._reasoning is not None and opens_reasoning(prompt)
        reasoning = None if self._reasoning is None or prompt.rstrip().endswith(END) else \
            "opened" if opened else "optional"  # the <think> block the grammar lets the model write first
        grammar = self._grammar(turn, parser, reasoning)
        return TurnPlan(prompt, OutputParser(self._reasoning, parser), opened, grammar, self._decode)

    def _tool_parser(self, turn: AgentTurn) -> ToolCallParser | None:
        """The parser reading this turn's calls (None: none are read)."""
        name, mode, key = self.options.tool_call_parser, turn.choice.mode, turn.spelled("tool_choice")
        if mode == "none":
            return None
        if mode == "auto" and not self.options.enable_auto_tool_choice:
            raise refuse(key, key, "auto", "needs the server started with "
                         "--enable-auto-tool-choice and --tool-call-parser NAME (as vLLM); or send 'none', "
                         "'required' or a named function")
        return tool_call_parser(name or CONSTRAINED_DEFAULT_PARSER, RequestError)

    def _grammar(self, turn: AgentTurn, parser: ToolCallParser | None, reasoning: str | None) -> str | None:
        choice = turn.choice
        if parser is None or (choice.mode == "auto" and not any(t.strict for t in turn.tools)):
            return None
        tools: tuple[Tool, ...] = turn.tools
        if choice.mode == "function":
            tools = tuple(t for t in turn.tools if t.name == choice.name)
        auto = choice.mode == "auto"
        return tool_grammar(self._layout(parser), [(t.name, t.parameters) for t in tools],
                            parallel=turn.parallel_tool_calls and choice.mode != "function", auto=auto,
                            marker=getattr(parser.fmt, "MARKER", None), reasoning=reasoning, tokens=self.added)

    def _layout(self, parser: ToolCallParser) -> CallLayout:
        if parser.name == "mistral" and self.tokenizer.token_to_id("[ARGS]") is None:
            return mistral.LIST_LAYOUT
        return parser.layout
