"""A request's new tokens as its client sees them: appended one at a time until a stop rule fires,
turned into text incrementally, and counted in the metrics.

After each token the stop rules are checked in this order: a stop token (end-of-sequence unless
`ignore_eos`, and `stop_token_ids`), a stop string in the text (cut off: `detokenizer.py`), a
grammar whose document is complete ("stop"), then `max_tokens` or `max_model_len` ("length").
Tokens after the one that stopped the request (speculative decoding emits several a step) are
dropped.
"""

from __future__ import annotations

import time

from tessera.infer.engine.detokenizer import IncrementalDetokenizer
from tessera.infer.engine.metrics import EngineMetrics
from tessera.infer.engine.sequence import RequestOutput, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, metrics: EngineMetrics):
        self.tokenizer, self.max_model_len, self.metrics = tokenizer, max_model_len, metrics
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        params = seq.params
        self.detokenizers[seq.request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                                   params.skip_special_tokens)

    def append(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append `tokens` to `seq` one by one until a stop rule fires: (the tokens appended, the
        finish reason or None)."""
        detok, params = self.detokenizers[seq.request_id], seq.params
        appended, reason = [], None
        for tok in tokens:
            seq.token_ids.append(tok)
            appended.append(tok)
            if tok in seq.stop_ids:
                reason = "stop"
            elif detok.add(tok) or (seq.grammar is not None and seq.grammar.finished):
                reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival)
        self.metrics.generation_tokens += len(appended)
        return appended, reason

    def running(self, seq: Sequence, appended: list[int]) -> RequestOutput:
        """The output of a step after which `seq` goes on: the text that can no longer change."""
        detok = self.detokenizers[seq.request_id]
        delta = detok.release(final=False)
        return RequestOutput(seq.request_id, appended, delta, detok.text[:detok.sent], seq.output_ids, False, None,
                             seq.num_prompt, **_logprobs_of(seq))

    def finished(self, seq: Sequence, appended: list[int], error: str | None = None,
                 client_error: bool = False) -> RequestOutput:
        """The last output of `seq`, whose `finish_reason` is set: the rest of its text."""
        reason = seq.finish_reason
        n_out = len(seq.output_ids)
        if reason in ("stop", "length") and seq.first_token_time is not None and n_out > 1:
            self.metrics.tpot.observe((time.monotonic() - seq.first_token_time) / (n_out - 1))
        self.metrics.finish(reason)
        detok = self.detokenizers.pop(seq.request_id)
        delta = detok.release(final=True)
        return RequestOutput(seq.request_id, appended, delta, detok.text, seq.output_ids, True, reason, seq.num_prompt,
                             error, client_error, **_logprobs_of(seq),
                             stop_string=detok.matched if reason == "stop" else None,
                             cached_tokens=seq.prompt_cached or 0)


def _logprobs_of(seq: Sequence) -> dict:
    """The log-probabilities an output carries (copies: the sequence goes on appending)."""
    params = seq.params
    return {"logprobs": None if params.logprobs is None else list(seq.logprobs),
            "prompt_logprobs": None if params.prompt_logprobs is None else list(seq.prompt_logprobs)}
