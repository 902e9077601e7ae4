"""The `--nproc` launcher sees a rank's failure whichever rank it is: rank 0 waiting for a dead peer (as in
a collective) does not hide the failure of a rank after it, so the job stops with that rank's status instead
of waiting as long as rank 0 does."""

from __future__ import annotations

import sys
import time

from tessera.parallel.jobs.launch import FAILURE_GRACE_S, KILL_AFTER_S, launch_local
from tests.hang_guard import HANG_S

# Rank 0 waits (as a rank blocked in a collective with a dead peer would, up to its collective timeout);
# the last rank fails at once with status 3; the others finish.
_RANKS = """
import os, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if rank == 0:
    time.sleep({wait})
sys.exit(3 if rank == world - 1 else 0)
"""


def test_a_failure_behind_a_waiting_rank_0_stops_the_job():
    wait = HANG_S
    start = time.monotonic()
    status = launch_local(3, [sys.executable, "-c", _RANKS.format(wait=wait)])
    elapsed = time.monotonic() - start
    assert status == 3
    # Not a speed: the job ended through the failure path (grace, then SIGTERM to rank 0), long before
    # rank 0's own wait would have ended it.
    assert elapsed < wait - FAILURE_GRACE_S - KILL_AFTER_S, elapsed
