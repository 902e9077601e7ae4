"""The OpenAI API's request fields and response objects, as far as Tessera serves them.

Requests are plain JSON dicts, checked field by field so that a bad value gets a 400 naming the
field (instead of a validation dump). Supported: `model`, `prompt` (string, list of strings, list
of token ids, or list of such lists), `messages` (chat; text and `image_url` parts: media.py),
`max_tokens` / `max_completion_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `stream`,
`stream_options.include_usage`, `n` (1..MAX_N independent choices per prompt; `best_of` only equal
to it), `user` (ignored), `response_format` (`text`, `json_object`, `json_schema`: see
`structured_output`), `presence_penalty`, `frequency_penalty`, `repetition_penalty` (a vLLM
extra), `logit_bias`, and log-probabilities: `logprobs: k` and `echo` on completions,
`logprobs: true` with `top_logprobs: k` on chat (k <= MAX_LOGPROBS; `openai_logprobs`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tessera.config.errors import RequestError
from tessera.infer.api.quoting import brief
from tessera.infer.sampling.params import MAX_LOGPROBS, SamplingParams

_NUMBER = (int, float)


class ProtocolError(RequestError):
    """A request the API refuses; `status` is the HTTP status to answer with, `param` the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message, field=param)
        self.status, self.param = status, param

    @classmethod
    def of(cls, e: RequestError, chat: bool) -> ProtocolError:
        """The HTTP answer to a request the engine (or `SamplingParams`) refused: 400, its field as
        the API names it (a prompt is a chat's `messages`, and so are its images; an adapter, `model`)."""
        field = {"adapter": "model", "images": "messages"}.get(e.field, e.field)
        return cls(str(e), param="messages" if chat and field == "prompt" else field)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: a 5xx is the server's fault ("server_error"), a 4xx the request's."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    if status >= 500:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _field(body: dict, key: str, types: type | tuple, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"'{key}' must be {_type_names(types)}, got a boolean", param=key)
    if not isinstance(value, types):
        raise ProtocolError(f"'{key}' must be {_type_names(types)}, got {type(value).__name__}", param=key)
    return value


def _type_names(types: type | tuple) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


# OpenAI fields the engine does not implement, with the value that means "off": anything else is
# refused with a 400 naming the field, rather than silently ignored.
UNSUPPORTED = {"suffix": None}
MAX_N = 16  # choices per prompt


def sampling_params(body: dict, default_max_tokens: int, chat: bool = False) -> SamplingParams:
    """SamplingParams from the request body; ProtocolError naming the field when one is wrong."""
    for key, off in UNSUPPORTED.items():
        value = body.get(key, off)
        if value not in (off, None):
            raise ProtocolError(f"'{key}' is not supported by this server (leave it unset or {off!r})", param=key)
    choices_per_prompt(body)
    max_tokens = _field(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", int, default_max_tokens)
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ProtocolError("'stop' must be a string or a list of strings", param="stop")
    stop_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ProtocolError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    logprobs, prompt_logprobs = (_chat_logprobs if chat else _completion_logprobs)(body)
    logit_bias = _logit_bias(body)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(_field(body, "temperature", _NUMBER, 1.0)),
                              top_p=float(_field(body, "top_p", _NUMBER, 1.0)), top_k=_field(body, "top_k", int, 0),
                              seed=_field(body, "seed", int, None), stop=stop, stop_token_ids=stop_ids,
                              ignore_eos=_field(body, "ignore_eos", bool, False),
                              skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
                              response_format=_field(body, "response_format", dict, None),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=float(_field(body, "presence_penalty", _NUMBER, 0.0)),
                              frequency_penalty=float(_field(body, "frequency_penalty", _NUMBER, 0.0)),
                              repetition_penalty=float(_field(body, "repetition_penalty", _NUMBER, 1.0)),
                              logit_bias=logit_bias)
    except RequestError as e:
        raise ProtocolError.of(e, chat) from e


def choices_per_prompt(body: dict) -> int:
    """`n`, in [1, MAX_N]. `best_of` may only repeat it: no candidates are generated to be ranked."""
    n = _field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ProtocolError(f"'n' must be an integer in [1, {MAX_N}], got {n}", param="n")
    best_of = _field(body, "best_of", int, None)
    if best_of is not None and best_of != n:
        raise ProtocolError(f"'best_of' must be unset or equal to 'n' ({n}): this server does not rank "
                            "extra candidates", param="best_of")
    return n


def _top_count(body: dict, key: str) -> int | None:
    value = _field(body, key, int, None)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ProtocolError(f"'{key}' must be an integer in [0, {MAX_LOGPROBS}], got {value}", param=key)
    return value


def _completion_logprobs(body: dict) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of a completions request: `logprobs: k`, and `echo` also scores
    the prompt with the same k."""
    if body.get("top_logprobs") is not None:
        raise ProtocolError("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': k", param="top_logprobs")
    if body.get("logprobs") is False:
        return None, None
    logprobs = _top_count(body, "logprobs")
    echo = _field(body, "echo", bool, False)
    return logprobs, logprobs if echo else None


def _chat_logprobs(body: dict) -> tuple[int | None, None]:
    """(logprobs, None) of a chat request: `logprobs: true` with `top_logprobs: k` (default 0)."""
    if body.get("echo") not in (None, False):
        raise ProtocolError("'echo' is served on /v1/completions only", param="echo")
    want = _field(body, "logprobs", bool, False)
    top = _top_count(body, "top_logprobs")
    if top is not None and not want:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if want else None, None


def _logit_bias(body: dict) -> dict[int, float]:
    """`logit_bias`: token ids (as JSON object keys) to numbers."""
    bias = _field(body, "logit_bias", dict, {})
    out = {}
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also takes "²" and other digits that int() refuses
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise ProtocolError(f"'logit_bias' keys must be token ids (non-negative integers), got {brief(key)}",
                                param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise ProtocolError(f"'logit_bias' values must be numbers in [-100, 100], got {brief(value)}",
                                param="logit_bias")
        out[int(key)] = float(value)
    return out


def prompts_of(body: dict) -> list[str | list[int]]:
    """The prompts of a completion request: strings or token-id lists."""
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in p):
        if len(p) > 64:
            raise ProtocolError("at most 64 prompts per request", param="prompt")
        return list(p)
    raise ProtocolError("'prompt' must be a non-empty string, list of strings, or list(s) of token ids",
                        param="prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens found in the prefix cache (a router reads
    them, infer/fleet/replica_router.py)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_object(rid: str, model: str, choices: list[dict], use: dict | None, chat: bool) -> dict:
    obj = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    return obj


def choice(index: int, text: str, finish_reason: str | None, chat: bool, stream: bool,
           first: bool = False, logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if stream:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chunk_object(rid: str, model: str, choices: list[dict], chat: bool, use: dict | None = None) -> dict:
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    return obj
