"""JSON and text read strictly: whatever Tessera reads from a file, a request or a command line is
checked once, where it enters, so that nothing deeper fails on it with a traceback.

JSON (`parse_json`): besides invalid UTF-8 and invalid JSON, Python's parser stops with a
`RecursionError` on a document nested a few thousand levels deep, and it accepts `"\\ud800"`: a
lone UTF-16 surrogate, which is no Unicode character. Such a string cannot be encoded as UTF-8, so
it breaks every consumer that does (tokenizers: "TextInputSequence must be str", file names,
HTTP responses). Both are refused with the caller's error type, naming the source and, for a
surrogate, where in the document it is.

Text (`check_text`): a string from elsewhere (a command-line argument, where the OS's
undecodable bytes arrive as surrogates too, or a YAML value) is checked the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.config.errors import TesseraError


def check_text(text: str, what: str, error: type[TesseraError]) -> str:
    """`text` if it is Unicode text (encodable as UTF-8); `error` naming `what` and the first
    character that is not (a lone surrogate) otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(f"{what} is not valid Unicode text: character {e.start} is a lone surrogate "
                    f"({ascii(text[e.start])}); send or write it as UTF-8") from None
    return text


def check_json_text(value: Any, source: str, error: type[TesseraError]) -> Any:
    """`value` (parsed JSON) if every string in it, keys included, is Unicode text; `error` naming
    `source` and the path of the first that is not (`$.messages[0].content`). Iterative: a deep
    document does not exhaust the stack here either."""
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            check_text(item, f"{source}: {path}", error)
        elif isinstance(item, dict):
            for key, child in item.items():
                check_text(key, f"{source}: a key in {path}", error)
                stack.append((child, f"{path}.{key if len(key) <= 40 else key[:40] + '...'}"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return value


def parse_json(data: bytes | str, source: str, error: type[TesseraError]) -> Any:
    """The JSON document in `data`, every string in it Unicode text; `error` naming `source` for
    anything else: not UTF-8, not JSON, nested too deeply to parse, or holding a lone surrogate."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise error(f"{source} is nested too deeply to parse (JSON arrays and objects inside each other "
                    "a thousand levels or more)") from None
    except ValueError as e:  # invalid UTF-8 or JSON, and integers of more than 4300 digits
        raise error(f"{source} is not valid JSON: {str(e)[:200]}") from None
    return check_json_text(value, source, error)


def read_json_file(path: Path, error: type[TesseraError], what: str | None = None) -> Any:
    """The JSON document in file `path` (`parse_json`), `error` if it cannot be read either;
    `what` names it in messages (default: the path)."""
    source = what or repr(str(path))
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"cannot read {source}: {e.strerror or e}") from None
    return parse_json(data, source, error)


def read_json_lines(path: Path) -> list[Any]:
    """The JSON value of each line of a log Tessera appends to (metrics.jsonl, events.jsonl); [] when
    there is no file. A line that does not parse is skipped: the last one may be cut short by a kill."""
    if not path.exists():
        return []
    values = []
    for line in path.read_text().splitlines():
        try:
            values.append(json.loads(line))
        except (ValueError, RecursionError):  # cut short, or not written by Tessera
            continue
    return values
