"""Restarting a job after a rank failed: `tessera train --nproc N --max-restarts K`.

When a rank of an attempt fails, the launcher (tessera.parallel.jobs.launch) stops the others, picks the
rank whose failure ended the attempt (`failing_rank`) and asks `RestartPolicy` whether to start all
N ranks again. They are started with TORCHELASTIC_RESTART_COUNT set to the attempt's number, as
torchrun sets it for a job it restarts under its own `--max-restarts`, and the trainer treats a
restarted rank like `--resume`: every rank continues from the newest good checkpoint, and
metrics.jsonl drops what was logged after it, so each step is logged once.

The policy restarts up to K times, and never after a failure that repeats at the step where the
previous attempt failed: a failure that comes back at the same place (a bad batch, a deterministic
crash, a layout that cannot start) is not cured by restarting, and would loop K times for nothing.
Each restart and each refusal is logged with its cause (the rank, its exit status or signal, its
error line and the step) in run_dir/events.jsonl and on stderr (tessera.parallel.jobs.events).
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from tessera.parallel.jobs.collective_timeout import PEER_FAILURE_MARKERS
from tessera.parallel.jobs.events import append_event


@dataclass(frozen=True)
class RankExit:
    """A rank that ended with a failure: its Popen return code (negative: killed by that signal), the
    step it was training when it ended (None: before its first) and its error line, if it gave one."""

    rank: int
    returncode: int
    step: int | None = None
    error: str | None = None

    @property
    def cause(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with status {self.returncode}" + (f" ({self.error})" if self.error else "")

    @property
    def where(self) -> str:
        return f"during step {self.step}" if self.step is not None else "before its first step"

    @property
    def peer_caused(self) -> bool:
        return self.returncode > 0 and self.error is not None and any(
            m in self.error.lower() for m in PEER_FAILURE_MARKERS)


def failing_rank(exits: list[RankExit]) -> RankExit:
    """The rank whose failure ended an attempt, of those that failed before the launcher stopped the
    rest (in the order they were seen): one killed by a signal first (it could not say why), then one
    whose error is its own rather than a peer's connection closing under it, then the first seen."""
    killed = [e for e in exits if e.returncode < 0]
    own = [e for e in exits if not e.peer_caused]
    return (killed or own or exits)[0]


class RestartPolicy:
    """Decides, after each failed attempt, whether to start the job again, and logs it."""

    def __init__(self, max_restarts: int, nproc: int, run_dir: str | Path | None):
        self.max_restarts, self.nproc, self.run_dir = max_restarts, nproc, run_dir
        self.restarts = 0
        self._previous: RankExit | None = None

    def restart_after(self, failure: RankExit) -> bool:
        """True: start every rank again (restart number `self.restarts`); False: the job ends with
        `failure`. Both are logged when restarts were asked for."""
        if self.max_restarts == 0:
            return False
        previous, self._previous = self._previous, failure
        fields = {"rank": failure.rank, "returncode": failure.returncode, "step": failure.step,
                  "cause": failure.cause, "restarts": self.restarts, "max_restarts": self.max_restarts}
        what = f"rank {failure.rank} {failure.cause} {failure.where}"
        if previous is not None and previous.step == failure.step:
            reason = (f"{what}, where the previous attempt failed too (rank {previous.rank} {previous.cause}): a "
                      "failure that repeats at the same step is not cured by restarting; fix its cause, then run "
                      "again with --resume")
            self._log("restart_refused", {**fields, "reason": "repeated at the same step"}, reason)
            return False
        if self.restarts >= self.max_restarts:
            reason = (f"{what}, and all {self.max_restarts} restarts (--max-restarts {self.max_restarts}) are used; "
                      "run again with --resume to continue")
            self._log("restart_refused", {**fields, "reason": "no restarts left"}, reason)
            return False
        self.restarts += 1
        self._log("restart", {**fields, "restart": self.restarts},
                  f"restart {self.restarts} of {self.max_restarts}: {what}; starting {self.nproc} ranks again, "
                  "from the newest good checkpoint", prefix="")
        return True

    def _log(self, event: str, fields: dict, message: str, prefix: str = "not restarting: ") -> None:
        line = f"tessera train: {prefix}{message}"
        if self.run_dir is not None:
            append_event(self.run_dir, event, fields, line)
        else:
            print(line, file=sys.stderr, flush=True)
