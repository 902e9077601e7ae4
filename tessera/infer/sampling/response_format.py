"""The OpenAI API's `response_format` field: its shapes, and the JSON schema each one asks for.

`{"type": "text"}` is free text, `{"type": "json_object"}` any JSON object, and
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` the given
schema. Checking the shape needs no torch and no grammar engine, so `SamplingParams` does it when a
request is made; the schema itself is compiled when the request is admitted (`structured_output`).
"""

from __future__ import annotations

import re
from typing import Any

from tessera.config.errors import RequestError
from tessera.infer.api.quoting import brief

FORMAT_TYPES = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class GrammarError(RequestError):
    """A `response_format` that cannot be served: a malformed field or a schema that does not compile."""

    def __init__(self, message: str, field: str | None = "response_format"):
        super().__init__(message, field)


def invalid_format(value: Any, why: str) -> GrammarError:
    return GrammarError(f"response_format={brief(value)} is invalid: {why}")


def schema_of(response_format: dict | None) -> dict | None:
    """The JSON schema a `response_format` asks for (None for free text); GrammarError naming the
    field when the object is not shaped as in the OpenAI API."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise invalid_format(response_format, "must be an object with a 'type'")
    kind = response_format.get("type")
    if kind not in FORMAT_TYPES:
        raise invalid_format(response_format, f"'type' must be one of {', '.join(FORMAT_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_format(response_format,
                             "type 'json_schema' needs 'json_schema': {\"name\": ..., \"schema\": {...}}")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.match(name)):
        raise invalid_format(response_format, "json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid_format(response_format, "json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise invalid_format(response_format, "json_schema.schema must be a JSON schema object")
    return schema
