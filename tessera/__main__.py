"""`python -m tessera ...` is the `tessera` command, and what every rank of `--nproc` and torchrun runs."""

import logging
import os
import sys

from tessera.cli import main

status = main()
if status != 0 and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
    # A rank that failed has said why and closed its files (the trainer's `finally`). It ends
    # without the interpreter's teardown: there torch's process-group objects, left mid-setup by
    # an early failure, can abort the process ("terminate called without an active exception",
    # about 1 run in 20 under load), and the launcher would then report status 134 instead of this one.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)
