"""Write a file under a temporary name in its final directory, then rename it into place.

`os.replace` within one directory is atomic on POSIX, so a reader sees either the old file or the
complete new one, never a half-written one, and an interrupted run leaves only a `*.tmp` file
behind instead of damaging what was already on disk.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _process_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def temporary_sibling(final: Path) -> Path:
    """Create and return an empty, uniquely named temporary file next to `final`.

    `mkstemp` makes the file private (0600); it gets the permissions an ordinary `open` would
    give, so the renamed result looks like any other file the user writes.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_UMASK)
    os.close(fd)
    return Path(name)


def commit(temporary: Path, final: Path) -> None:
    """Flush `temporary` to disk and rename it to `final` (replacing any file already there)."""
    with open(temporary, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(temporary, final)


def discard(temporary: Path) -> None:
    """Remove a temporary file if it still exists."""
    temporary.unlink(missing_ok=True)


@contextmanager
def atomic_output(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes `final`, on error it is removed."""
    final = Path(final)
    temporary = temporary_sibling(final)
    try:
        yield temporary
        commit(temporary, final)
    finally:
        discard(temporary)
