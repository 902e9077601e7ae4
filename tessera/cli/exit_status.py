"""What a `tessera` command's exit status says, and the one line it prints on stderr.

One mapping for every subcommand: bad input (a config key, a flag, a layout that does not fit the
world or the model) exits 2, so a script can tell a typo from a failure; any other error Tessera
reports itself (a damaged or foreign checkpoint, a missing dataset, a model directory that cannot
be served, a rank that failed) exits 1; Ctrl-C exits 130, as a shell reports SIGINT. Errors Tessera
does not report itself (a bug, CUDA out of memory) keep Python's traceback (`tessera/__main__.py`).
"""

from __future__ import annotations

import os
import sys

from tessera.config.errors import ConfigError, ParallelError, TesseraError

BAD_INPUT = 2
FAILED = 1
INTERRUPTED = 130


def exit_status(error: TesseraError | KeyboardInterrupt) -> int:
    """The exit status of a command that ended with `error`."""
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    return BAD_INPUT if isinstance(error, (ConfigError, ParallelError)) else FAILED


def report(command: str, error: TesseraError | KeyboardInterrupt) -> int:
    """Say on stderr, in one line, why `tessera <command>` stops; return its exit status."""
    if isinstance(error, KeyboardInterrupt):
        print(f"tessera {command}: interrupted", file=sys.stderr)
    else:
        print(f"tessera {command}: error: {rank_prefix()}{one_line(error)}", file=sys.stderr)
    return exit_status(error)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def rank_prefix() -> str:
    """'[rank R] ' in a process started as one rank of several (torchrun, --nproc), else ''."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"[rank {rank}] " if world.isdigit() and int(world) > 1 else ""  # several ranks print at once
