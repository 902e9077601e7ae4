"""The choices of one OpenAI request: which engine request each is, and its JSON as the outputs come.

A request of P prompts and `n` choices per prompt runs P * n engine requests; choice index
i * n + j is prompt i's j-th sample (vLLM's numbering). With a `seed`, sample j of a prompt uses
seed + j, so the choices differ from each other and the request is reproducible. `echo`
(completions) puts the prompt's text (the string sent, or the decoding of the token ids sent)
before the completion, and with `logprobs` the prompt's tokens before the completion's in the
logprobs object (`openai_logprobs`). When streaming, the echo comes with the choice's first chunk,
and each chunk carries the log-probabilities of the tokens its step produced (whose text may come
in a later chunk, when the stop-string check holds it back).

A chat request whose output is read (a reasoning parser, or tools whose calls are read: the agent
turn's plan, tessera/infer/agents/turn_plan.py) answers with the turn's reasoning, content and tool
calls (`openai_tools`), whole or delta by delta, and usage counts its reasoning tokens.
"""

from __future__ import annotations

import dataclasses

from tessera.infer.agents.turn_output import TurnDecoder
from tessera.infer.agents.turn_plan import TurnPlan
from tessera.infer.api.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, text_length
from tessera.infer.api.openai_protocol import choice, usage
from tessera.infer.api.openai_tools import chat_delta, chat_message, usage_details
from tessera.infer.engine.sequence import RequestOutput
from tessera.infer.sampling.params import SamplingParams


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of a prompt's j-th choice: its own seed when the request has one."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**63)


class Choices:
    """The JSON of each choice of one request; `prompts`: each prompt's token ids, `echoes` its
    text to echo (None: no echo)."""

    def __init__(self, chat: bool, params: SamplingParams, n: int, prompts: list[list[int]],
                 echoes: list[str] | None, texts: TokenTexts, turn: TurnPlan | None = None):
        self.chat, self.params, self.n, self.prompts, self.echoes, self.texts = chat, params, n, prompts, echoes, texts
        self.offsets: dict[int, int] = {}  # streamed completions: where the next token's text starts
        self.started: set[int] = set()
        self.turn = turn if turn is not None and turn.reads_output else None  # None: the output is all content
        self.decoders: dict[int, TurnDecoder] = {}
        self.reasoning_tokens = 0

    def _echo(self, index: int, out: RequestOutput) -> tuple[str, list]:
        """The echoed text and logprobs entries of choice `index` (nothing without echo)."""
        if self.echoes is None:
            return "", []
        prompt = self.prompts[index // self.n]
        entries = []
        if out.prompt_logprobs is not None:
            entries = [(prompt[0], None)] + [(lp.token_id, lp) for lp in out.prompt_logprobs]
        return self.echoes[index // self.n], entries

    def _logprobs(self, index: int, echoed: list, new: list, offset: int) -> dict | None:
        if self.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, new)
        return completion_logprobs(self.texts, echoed + [(lp.token_id, lp) for lp in new], offset)

    def final(self, index: int, out: RequestOutput) -> dict:
        """A finished choice of a response that is not streamed."""
        echo_text, echoed = self._echo(index, out)
        logprobs = self._logprobs(index, echoed, out.logprobs or [], 0)
        if self.turn is not None:
            read = self.turn.output(out)
            self.reasoning_tokens += read.reasoning_tokens
            return {"index": index, "message": chat_message(read, self.turn.reads_reasoning), "logprobs": logprobs,
                    "finish_reason": read.finish_reason}
        return choice(index, echo_text + out.text, out.finish_reason, self.chat, stream=False, logprobs=logprobs)

    def chunk(self, index: int, out: RequestOutput) -> dict | None:
        """The streamed chunk of one output of choice `index` (None when it brings nothing)."""
        first = index not in self.started
        self.started.add(index)
        echo_text, echoed = self._echo(index, out) if first else ("", [])
        new = (out.logprobs or [])[len(out.logprobs or []) - len(out.new_token_ids):] if out.logprobs else []
        if not (out.delta or out.finished or echo_text or new):
            return None
        logprobs = self._logprobs(index, echoed, new, self.offsets.get(index, 0))
        if logprobs is not None and not self.chat:
            self.offsets[index] = text_length(logprobs) or self.offsets.get(index, 0)
        if self.turn is not None:
            return self._turn_chunk(index, out, logprobs)
        return choice(index, echo_text + out.delta, out.finish_reason, self.chat, True, logprobs=logprobs)

    def _turn_chunk(self, index: int, out: RequestOutput, logprobs: dict | None) -> dict | None:
        decoder = self.decoders.setdefault(index, self.turn.decoder())
        read = decoder.step(out)
        if out.finished:
            self.reasoning_tokens += decoder.reasoning_tokens
        if not (read or logprobs):
            return None
        return {"index": index, "delta": chat_delta(read), "logprobs": logprobs, "finish_reason": read.finish_reason}

    @property
    def constraint_field(self) -> str:
        """The request field whose constraint decoding follows: the tools' where calls are constrained."""
        return "tools" if self.turn is not None and self.turn.guided_grammar is not None else "response_format"

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The request's usage, with its reasoning tokens where a reasoning parser reads them."""
        use = usage(prompt_tokens, completion_tokens, cached_tokens)
        return usage_details(use, self.reasoning_tokens) if self.turn is not None and self.turn.reads_reasoning \
            else use
