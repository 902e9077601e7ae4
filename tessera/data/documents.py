"""Read documents out of text and JSONL files, naming the file and line of anything malformed.

Inputs are files or directories. A directory stands for every `.txt` and `.jsonl` file below it,
in sorted order, so the same tree always yields the same documents in the same order.

- `.txt`: the whole file is one document (`text_mode="document"`), or every non-empty line is
  one (`text_mode="line"`). Files must be UTF-8.
- `.jsonl`: one JSON object per line; blank lines are skipped. Pretraining reads the string field
  `jsonl_field` (default `"text"`); supervised fine-tuning reads whole records.

A file that holds no document (empty, or only blank lines / whitespace) is refused naming it
(DataError), whether named or found in a directory: it is a file that was meant to hold data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tessera.config.errors import DataError
from tessera.config.json_text import parse_json

INPUT_SUFFIXES = (".txt", ".jsonl")
TEXT_MODES = ("document", "line")


def expand_inputs(inputs: Sequence[str | os.PathLike],
                  suffixes: Sequence[str] = INPUT_SUFFIXES) -> list[Path]:
    """Files named directly, plus the files with an allowed suffix below each named directory."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise DataError(f"{path}: directory holds no input files "
                                f"(allowed suffixes: {', '.join(suffixes)})")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in suffixes:
                raise DataError(f"{path}: unsupported input file type {path.suffix!r} "
                                f"(allowed: {', '.join(suffixes)})")
            files.append(path)
        else:
            raise DataError(f"{path}: input file does not exist")
    if not files:
        raise DataError("no input files given")
    return files


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not valid UTF-8 at byte {error.start}") from error


def _no_documents(path: Path) -> DataError:
    """An input file that holds nothing: refused by name where it enters (preprocessing, training,
    calibration), since a dataset silently built without it, or of nothing, trains on the wrong data."""
    return DataError(f"{path}: no documents found: the file is empty or holds only blank lines; remove it from the "
                     "inputs or fill it")


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any], int]]:
    """`(line_number, record, size_in_bytes)` for each non-blank line of a JSONL file (at least one)."""
    skipped = 0  # bytes of blank lines, reported with the next record so progress adds up
    records = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, f"{path}:{number}")
            if not line.strip():
                skipped += len(raw)
                continue
            record = parse_json(line, f"{path}:{number}", DataError)
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, found {type(record).__name__}")
            records += 1
            yield number, record, len(raw) + skipped
            skipped = 0
    if not records:
        raise _no_documents(path)


def iter_text_documents(paths: Sequence[Path], *, jsonl_field: str = "text",
                        text_mode: str = "document") -> Iterator[tuple[str, int]]:
    """`(text, size_in_bytes)` for each document of the given files, in order."""
    if text_mode not in TEXT_MODES:
        raise DataError(f"text_mode {text_mode!r} is not allowed (allowed: {', '.join(TEXT_MODES)})")
    for path in paths:
        if path.suffix == ".jsonl":
            for number, record, size in iter_jsonl(path):
                if jsonl_field not in record:
                    raise DataError(f"{path}:{number}: no field {jsonl_field!r} "
                                    f"(fields present: {', '.join(sorted(record)) or 'none'})")
                text = record[jsonl_field]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{number}: field {jsonl_field!r} must be a string, "
                                    f"found {type(text).__name__}")
                yield text, size
        elif text_mode == "document":
            raw = path.read_bytes()
            text = _decode(raw, str(path))
            if not text.strip():
                raise _no_documents(path)
            yield text, len(raw)
        else:
            yield from _lines(path)


def _lines(path: Path) -> Iterator[tuple[str, int]]:
    """`(line, size_in_bytes)` for each non-blank line of a text file (at least one)."""
    skipped = lines = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, f"{path}:{number}").rstrip("\r\n")
            if line.strip():
                lines += 1
                yield line, len(raw) + skipped
                skipped = 0
            else:
                skipped += len(raw)
    if not lines:
        raise _no_documents(path)
