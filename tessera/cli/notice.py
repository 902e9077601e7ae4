"""What a command tells the user on stderr before it works: a one-line notice for a long phase
(loading a model, quantizing, generating), printed only when the phase is still running after
`NOTICE_AFTER_S` seconds, so that a command that fails at once keeps its one line and one that works
for minutes does not work in silence; and which file a package's name stood for (`packaged_model`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

NOTICE_AFTER_S = 2.0


@contextmanager
def notice_if_slow(text: str, after_s: float | None = None) -> Iterator[None]:
    """Print `text` on stderr if the block is still running after `after_s` (NOTICE_AFTER_S) seconds
    (nothing when `text` is empty)."""
    if not text:
        yield
        return
    timer = threading.Timer(NOTICE_AFTER_S if after_s is None else after_s,
                            lambda: print(text, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def packaged_model(name: str, command: str) -> str:
    """`name`, or the GGUF file of the installed package it names (`tessera.checkpoint.gguf.packaged`),
    said on stderr so that the user learns where the file is."""
    from tessera.checkpoint.gguf.packaged import model_source

    path = model_source(name)
    if path != name:
        print(f"tessera {command}: {name} is the package's GGUF file {path}", file=sys.stderr, flush=True)
    return path
