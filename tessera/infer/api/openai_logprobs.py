"""The `logprobs` objects of OpenAI responses, from the engine's `TokenLogprobs`.

/v1/completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
one entry per token; `top_logprobs` maps token text to log-probability for the token itself and
the k most likely ones (so up to k + 1 entries, as vLLM gives). With `echo` the prompt's tokens
come first; the first prompt token has no log-probability (null, and null top_logprobs).
`text_offset` is where each token's text starts in the choice's text.
/v1/chat/completions (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [k most likely, each {"token", "logprob", "bytes"}]}]}`.
A token's text is the tokenizer's decoding of that token alone (special tokens included);
without a tokenizer it is "token_id:N". Log-probabilities below -9999 (-inf) are sent as -9999.0,
since JSON has no infinity.
"""

from __future__ import annotations

from tessera.infer.sampling.logprobs import TokenLogprobs

FLOOR = -9999.0


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else \
                self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text


def _value(logprob: float) -> float:
    return max(logprob, FLOOR) if logprob == logprob else FLOOR  # NaN cannot reach a client as JSON


def completion_logprobs(texts: TokenTexts, entries: list[tuple[int, TokenLogprobs | None]],
                        offset: int = 0) -> dict:
    """The completions `logprobs` object of `entries` (token id, its log-probabilities or None for
    the first prompt token), the first token's text starting at character `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in entries:
        text = texts(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(lp.logprob))
        top = {text: _value(lp.logprob)}
        for tid, value in lp.top:
            top.setdefault(texts(tid), _value(value))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprobs]) -> dict:
    """The chat `logprobs` object of the completion tokens `entries`."""
    def item(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
                        for lp in entries]}


def text_length(logprobs: dict) -> int:
    """Characters the tokens of a completions `logprobs` object span (where the next one starts)."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
