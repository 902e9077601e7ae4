"""Render HuggingFace-style Jinja chat templates.

A chat template turns a list of `{"role", "content"}` messages into the one string a chat model
was trained on. Templates are written for the environment HuggingFace `transformers` renders
them in, so this one matches it: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, loop controls, a `tojson` filter, and the `raise_exception` and
`strftime_now` helpers. `{% generation %}` blocks (used by some templates to mark assistant
text) render their body unchanged; answer masks are computed from the rendered text instead
(see `tessera.data.sft`).

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
from typing import Any

from tessera.config.errors import DataError

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

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise DataError(f"chat template does not compile: {error}") from error


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = False,
                         special_tokens: dict[str, str | None] | None = None, **variables: Any) -> str:
    """Render `messages` with `template`; `special_tokens` supplies `bos_token`, `eos_token`, ... ."""
    import jinja2

    compiled = _compile(template)
    # Unset tokens stay undefined (rendering as ""), as in transformers, rather than "None".
    context = {name: token for name, token in (special_tokens or {}).items() if token is not None}
    context.update(variables)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as error:
        raise DataError(f"chat template failed to render: {error}") from error
