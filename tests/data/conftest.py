"""Fixtures shared by the data-layer tests: the shipped tokenizer and small text corpora on disk."""

import json
from pathlib import Path

import pytest

from tessera.data import Tokenizer, default_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return default_tokenizer()


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def write_jsonl():
    """`write_jsonl(path, records)` writes one JSON object per line and returns the path."""
    return _write_jsonl


@pytest.fixture
def text_corpus(tmp_path: Path) -> list[Path]:
    """Two JSONL files and a text file: 8 documents of varied length."""
    a = _write_jsonl(tmp_path / "a.jsonl", [{"text": f"def f{i}(x):\n    return x * {i}\n" * (i + 1)}
                                           for i in range(4)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"text": "import os\nprint(os.getcwd())\n"},
                                           {"text": "naïve café — ünïcode ✓ 日本語"},
                                           {"text": "class A:\n    pass\n" * 3}])
    c = tmp_path / "c.txt"
    c.write_text("A plain text document.\nWith two lines.\n", encoding="utf-8")
    return [a, b, c]
