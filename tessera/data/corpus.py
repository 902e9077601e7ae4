"""The bundled corpus: the Python standard library's own source code, as JSONL documents.

Every Python installation carries several megabytes of real, varied, well-written text in its
standard library, so Tessera can train and test on real data with nothing downloaded. The corpus
is a fixed selection of the running interpreter's stdlib `.py` files: sorted by relative path,
skipping test suites, site-packages and caches, and taken in that order until the next file would
pass `max_bytes`. Each file is one JSONL document `{"id": relative/path.py, "text": source}`.
The output depends only on the interpreter's stdlib and `max_bytes` (so the file name carries the
Python version).

`prepare_corpus_dataset(cache_dir, tokenizer)` builds the corpus and its tokenized indexed
dataset once under `cache_dir` and reuses them after; every file is written under a temporary
name and renamed, so an interrupted run is simply redone, and concurrent callers (every rank of a
job, say) each write identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tessera.config.errors import DataError
from tessera.data.atomic_write import atomic_output
from tessera.data.indexed import IndexedDataset
from tessera.data.preprocess import preprocess
from tessera.data.tokenizer import Tokenizer

DEFAULT_CORPUS_BYTES = 8_000_000  # ~8 MB: 557 files, about 2.3M tokens with the shipped tokenizer
SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                                 "__pycache__"})


@dataclass(frozen=True)
class CorpusStats:
    path: str
    documents: int
    text_bytes: int
    sha256: str


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def select_stdlib_files(max_bytes: int = DEFAULT_CORPUS_BYTES,
                        root: str | os.PathLike | None = None) -> list[Path]:
    """The corpus's source files, in corpus order (sorted relative paths), totalling <= `max_bytes`."""
    if max_bytes <= 0:
        raise DataError(f"corpus max_bytes must be positive, got {max_bytes}")
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise DataError(f"{root}: standard library directory not found")
    candidates = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        for name in names:
            path = Path(directory, name)
            if name.endswith(".py") and path.is_file():
                candidates.append((path.relative_to(root).as_posix(), path))
    selected, total = [], 0
    for _, path in sorted(candidates):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        selected.append(path)
        total += size
    return selected


def build_stdlib_corpus(output: str | os.PathLike, max_bytes: int = DEFAULT_CORPUS_BYTES,
                        root: str | os.PathLike | None = None) -> CorpusStats:
    """Write the corpus as JSONL to `output` (atomically); files that are not UTF-8 are left out."""
    root = Path(root) if root is not None else stdlib_root()
    digest, documents, text_bytes = hashlib.sha256(), 0, 0
    with atomic_output(output) as tmp, open(tmp, "wb") as f:
        for path in select_stdlib_files(max_bytes, root):
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            line = (json.dumps({"id": path.relative_to(root).as_posix(), "text": text}, ensure_ascii=False)
                    + "\n").encode("utf-8")
            f.write(line)
            digest.update(line)
            documents += 1
            text_bytes += len(raw)
    return CorpusStats(path=os.fspath(output), documents=documents, text_bytes=text_bytes,
                       sha256=digest.hexdigest())


def corpus_file_name(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    return f"stdlib-{platform.python_version()}-{max_bytes}.jsonl"


def prepare_corpus_dataset(cache_dir: str | os.PathLike, tokenizer: Tokenizer, *,
                           max_bytes: int = DEFAULT_CORPUS_BYTES, show_progress: bool = False) -> Path:
    """The prefix of the stdlib corpus tokenized by `tokenizer`, building it under `cache_dir` if needed.

    Idempotent: a second call finds the dataset and returns at once. The prefix's name carries a
    hash of the tokenizer and corpus, so another tokenizer or size gets its own dataset.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    corpus = cache_dir / corpus_file_name(max_bytes)
    if not corpus.is_file():
        build_stdlib_corpus(corpus, max_bytes)
    digest = hashlib.sha256(tokenizer.fingerprint.encode())
    with open(corpus, "rb") as f:
        digest.update(hashlib.file_digest(f, "sha256").digest())
    prefix = cache_dir / f"{corpus.stem}-{digest.hexdigest()[:16]}"
    try:
        IndexedDataset(prefix)
        return prefix
    except DataError:
        pass  # absent, or left incomplete by an interrupted run: (re)build it
    preprocess([corpus], prefix, tokenizer, jsonl_field="text", show_progress=show_progress)
    return prefix
