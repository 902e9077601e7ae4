"""`python -m tessera ...` is the `tessera` command; `tessera train --nproc N` starts each rank this
way, and torchrun does with `-m tessera`."""

import logging
import os
import sys
import traceback

from tessera.cli import main
from tessera.cli.exit_status import FAILED


def _launched_as_rank() -> bool:
    """Whether a launcher started this process as a rank of a process group (`--nproc N` for any
    N, torchrun): the rule by which the trainer joins one (tessera.parallel.jobs.launch)."""
    from tessera.config.errors import TesseraError
    from tessera.parallel.jobs.launch import rank_env

    try:
        return rank_env().distributed
    except TesseraError:  # rank variables that are not numbers: the command has said so already
        return False


def _end_failed_rank(status: int) -> None:
    """A rank that failed has said why, and the trainer's `finally` has closed its files. It ends
    here, without the interpreter's teardown: there torch's process-group objects, left mid-use by
    an early failure, can abort the process ("terminate called without an active exception", about
    1 run in 20 under load), and the launcher would then report status 134 instead of this one.
    One process that no launcher started ends normally."""
    if not _launched_as_rank():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


try:
    status = main()
except Exception:  # an error the command does not report itself: Python's report, then FAILED
    traceback.print_exc()
    _end_failed_rank(FAILED)
    sys.exit(FAILED)
if status != 0:
    _end_failed_rank(status)
sys.exit(status)
