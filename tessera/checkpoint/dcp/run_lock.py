"""One trainer per run directory: an advisory lock held for the life of the run.

Two trainers on one `run_dir` would delete each other's temporary checkpoints, move each other's
`latest` pointer and interleave their metrics. The first takes an exclusive `flock` on
`run_dir/.lock` (written with its PID) and keeps it until the run ends; a second is refused with a
ConfigError naming the holder's PID. The kernel releases the lock when the holder dies, however it
dies, so a crashed run never leaves a stale lock behind. Rank 0 alone holds it for a multi-rank run.

The same check refuses, before any model is built, a `run_dir` that is a file or that cannot be
written (a read-only file system, missing permissions).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tessera.config.errors import ConfigError

LOCK_FILE = ".lock"


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory; `acquire` creates the directory."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        if self._fd is not None:
            return self
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run_dir={str(self.run_dir)!r} is a file, not a directory; choose a directory")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.run_dir, os.W_OK):  # also a read-only file system, even for root
                raise PermissionError(13, "read-only")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"run_dir={str(self.run_dir)!r} cannot be written ({e.strerror}); choose a "
                              "writable directory") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"run_dir={str(self.run_dir)!r} is in use by another trainer (PID {holder}); "
                              "wait for it to finish, stop it, or choose another run_dir") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"run_dir={str(self.run_dir)!r} cannot be written ({e.strerror}); choose a "
                              "writable directory") from e
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (closing the descriptor releases the flock); the file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
