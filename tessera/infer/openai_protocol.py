"""The OpenAI API's request fields and response objects, as far as Tessera serves them.

Requests are plain JSON dicts, checked field by field so that a bad value gets a 400 naming the
field (instead of a validation dump). Supported: `model`, `prompt` (string, list of strings, list
of token ids, or list of such lists), `messages` (chat), `max_tokens` / `max_completion_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `stream`,
`stream_options.include_usage`, `n` (only 1), `user` (ignored), `response_format` (`text`,
`json_object`, `json_schema`: see `structured_output`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tessera.config.errors import ConfigError
from tessera.infer.sampling_params import SamplingParams

_NUMBER = (int, float)


class ProtocolError(ConfigError):
    """A request the API refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


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
UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": None, "top_logprobs": None,
               "logit_bias": None, "best_of": 1, "echo": False, "suffix": None}


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from the request body; ProtocolError naming the field when one is wrong."""
    for key, off in UNSUPPORTED.items():
        value = body.get(key, off)
        if value not in (off, None) and not (key == "logprobs" and value is False) and value != {}:
            raise ProtocolError(f"'{key}' is not supported by this server (leave it unset or {off!r})", param=key)
    if _field(body, "n", int, 1) != 1:
        raise ProtocolError("'n' must be 1 (one choice per prompt)", param="n")
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
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(_field(body, "temperature", _NUMBER, 1.0)),
                              top_p=float(_field(body, "top_p", _NUMBER, 1.0)), top_k=_field(body, "top_k", int, 0),
                              seed=_field(body, "seed", int, None), stop=stop, stop_token_ids=stop_ids,
                              ignore_eos=_field(body, "ignore_eos", bool, False),
                              skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
                              response_format=_field(body, "response_format", dict, None))
    except ConfigError as e:
        raise ProtocolError(str(e), param=str(e).split("=")[0]) from e


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


def messages_of(body: dict) -> list[dict[str, str]]:
    """Chat messages with text content (OpenAI's list-of-parts content is joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                raise ProtocolError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(rid: str, model: str, choices: list[dict], use: dict | None, chat: bool) -> dict:
    obj = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    return obj


def choice(index: int, text: str, finish_reason: str | None, chat: bool, stream: bool,
           first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if stream:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chunk_object(rid: str, model: str, choices: list[dict], chat: bool, use: dict | None = None) -> dict:
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    return obj
