"""Render HuggingFace-style Jinja chat templates.

A chat template turns a list of `{"role", "content"}` messages into the one string a chat model
was trained on. Templates are written for the environment HuggingFace `transformers` renders
them in, so this one matches it: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, loop controls, a `tojson` filter, and the `raise_exception` and
`strftime_now` helpers. `{% generation %}` blocks (used by some templates to mark assistant
text) render their body unchanged; answer masks are computed from the rendered text instead
(see `tessera.data.sft`).

A template is code that comes with a model or tokenizer directory, and the server renders it for
every chat request, so its rendering is bounded like any other untrusted input: at most
`MAX_TEMPLATE_SECONDS` (a loop that would run for ever stops there: the rendering thread is traced
and interrupted at the deadline), at most `MAX_TEMPLATE_CHARS` of output (counted as it is
produced) and in any one string or list it builds by repetition or concatenation, no number above
`MAX_TEMPLATE_NUMBER` given to a filter or function or as a format width (`'x'|center(10**12)` would
allocate it in one step, before any count), and no integer above `MAX_TEMPLATE_BITS` bits. Each is
a `DataError` naming the bound. Not covered: a filter that multiplies its input by an allowed
number (`indent` of a very long text) can still allocate a large string before the count sees it.

When a tokenizer has no template of its own, fine-tuning uses `PLAIN_CHAT_TEMPLATE`: each turn is a
header line with the capitalized role (`"User:\\n"`, `"System:\\n"`, `"Assistant:\\n"`), the
content, and a blank line; an assistant's content is followed by `eos_token`, so a model learns to
end its answers with the end-of-document token. The header ends with a newline so that no token
joins the header to the answer's first word.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tessera.config.errors import DataError
from tessera.config.limits import MAX_TEMPLATE_BITS, MAX_TEMPLATE_CHARS, MAX_TEMPLATE_NUMBER, MAX_TEMPLATE_SECONDS

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ 'Assistant:\n' + message['content'] + (eos_token or '') + '\n\n' }}"
    "{% else %}"
    "{{ message['role'] | capitalize }}{{ ':\n' + message['content'] + '\n\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise DataError(f"chat template refused the conversation: {message}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class _OverBound(Exception):
    """Raised inside a rendering that passed one of the module's bounds; reported as a DataError."""


def _check_number(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_NUMBER:
        raise _OverBound(f"uses the number {value} where a chat template may use at most {MAX_TEMPLATE_NUMBER:,}")


# more digits than MAX_TEMPLATE_NUMBER has: a width past it, as in '%9999999999s' or '{:>9999999999}'
_WIDE = re.compile("[0-9]{" + str(len(str(MAX_TEMPLATE_NUMBER)) + 1) + ",}")


def _check_format(text: Any) -> None:
    if isinstance(text, str) and ("%" in text or "{" in text) and _WIDE.search(text):
        raise _OverBound("formats with a width larger than a chat template may use")


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """No huge number among a call's arguments (a width, a count), nor as a width in a format string."""
    for value in (*args, *kwargs.values()):
        _check_number(value)
        _check_format(value)


def _check_size(left: Any, operator: str, right: Any) -> None:
    """`left operator right` stays within the output bound (sequences) and a few thousand bits (integers)."""
    sized = (str, list, tuple)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        size = len(left) + len(right)
    elif operator == "*" and isinstance(left, sized) and isinstance(right, int):
        size = len(left) * right
    elif operator == "*" and isinstance(left, int) and isinstance(right, sized):
        size = left * len(right)
    elif isinstance(left, int) and isinstance(right, int) and operator in ("*", "**"):
        bits = left.bit_length() + right.bit_length() if operator == "*" else left.bit_length() * max(right, 0)
        if bits > MAX_TEMPLATE_BITS:
            raise _OverBound(f"computes a number of more than {MAX_TEMPLATE_BITS:,} bits")
        return
    else:
        return
    if size > MAX_TEMPLATE_CHARS:
        raise _OverBound(f"builds a string or list longer than a chat template may ({MAX_TEMPLATE_CHARS:,})")


def _bounded(function):
    """A filter that refuses huge numbers first (the wrapper keeps Jinja's pass_* markers)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return function(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    # Imported here so that the rest of the data layer works where jinja2 is absent.
    import jinja2
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with the module's bounds on sizes: repetition, concatenation, powers, `%`
        and `str.format` widths, and the numbers every call is given."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_size(left, operator, right)
            if operator == "%":
                _check_format(left)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_arguments(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Any:
            _check_format(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

    environment = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.filters.update({name: _bounded(f) for name, f in environment.filters.items()})
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise DataError(f"chat template does not compile: {error}") from error
    except RecursionError:
        raise DataError("chat template does not compile: nested too deeply") from None


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the code this thread runs inside the block once `seconds` have passed (a trace
    function, this thread only: rendering runs in the caller's thread)."""
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def trace(frame: Any, event: str, arg: Any):
        if time.monotonic() > deadline:
            raise _OverBound(f"ran longer than a chat template may ({seconds:g} s)")
        return trace

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = False,
                         special_tokens: dict[str, str | None] | None = None, **variables: Any) -> str:
    """Render `messages` with `template`; `special_tokens` supplies `bos_token`, `eos_token`, ... .
    Bounded in time, output and sizes (module docstring)."""
    import jinja2

    compiled = _compile(template)
    # Unset tokens stay undefined (rendering as ""), as in transformers, rather than "None".
    context = {name: token for name, token in (special_tokens or {}).items() if token is not None}
    context.update(variables)
    pieces, size = [], 0
    try:
        with _time_limit(MAX_TEMPLATE_SECONDS):
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **context):
                size += len(piece)
                if size > MAX_TEMPLATE_CHARS:
                    raise _OverBound(f"rendered more than a chat template may ({MAX_TEMPLATE_CHARS:,} characters)")
                pieces.append(piece)
    except _OverBound as error:
        raise DataError(f"chat template {error}; it was stopped") from None
    except jinja2.TemplateError as error:
        raise DataError(f"chat template failed to render: {error}") from error
    except (RecursionError, MemoryError, OverflowError) as error:
        raise DataError(f"chat template failed to render: {type(error).__name__}") from None
    return "".join(pieces)
