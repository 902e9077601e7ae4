"""Where each rank of a `tessera train --nproc N` job is, as its launcher sees it.

A rank that `launch_local` started (it sets TESSERA_REPORT_PROGRESS=1) keeps two keys up to date in
the launcher's TCP store, the one its process group met at: the step it is training
(`tessera/step/<rank>`, set as the step begins) and, when it fails with an error it can put in words,
that error in one line (`tessera/error/<rank>`). A rank killed outright (SIGKILL, the out-of-memory
killer) leaves its last step behind. When a rank fails the launcher reads them (`read_reports`): the
step the job failed at and its cause are what it logs, and what tells a failure that repeats at
the same step, which no restart will cure, from one that does not (tessera.parallel.jobs.restarts).

Reporting never stops training: a store that cannot be reached is given up on silently (a rank
whose launcher died is stopped by `watch_launcher` instead). Ranks torchrun started report nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

PROGRESS_ENV = "TESSERA_REPORT_PROGRESS"
_STEP_KEY = "tessera/step/{rank}"
_ERROR_KEY = "tessera/error/{rank}"
_CONNECT_S = 30.0  # a launcher's store on 127.0.0.1 answers at once; this only bounds a dead one
_MAX_ERROR_CHARS = 1000


class RankProgress:
    """This rank's reports to its launcher's store."""

    def __init__(self, store: dist.Store, rank: int):
        self._store: dist.Store | None = store
        self.rank = rank

    @classmethod
    def from_env(cls) -> RankProgress | None:
        """A reporter when `launch_local` started this process and asked for reports, else None."""
        if os.environ.get(PROGRESS_ENV) != "1":
            return None
        try:
            rank = int(os.environ["RANK"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  wait_for_workers=False, timeout=timedelta(seconds=_CONNECT_S))
        except (KeyError, ValueError, RuntimeError):  # no launcher to report to: train without reporting
            return None
        return cls(store, rank)

    def began(self, step: int) -> None:
        """This rank starts training `step`."""
        self._set(_STEP_KEY.format(rank=self.rank), str(step))

    def failed(self, message: str) -> None:
        """This rank ends with the error `message` (one line)."""
        self._set(_ERROR_KEY.format(rank=self.rank), " ".join(message.split())[:_MAX_ERROR_CHARS])

    def _set(self, key: str, value: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(key, value)
        except RuntimeError:  # the launcher is gone
            self._store = None


@dataclass(frozen=True)
class RankReport:
    """What a rank last told the launcher: the step it was training (None: it began none) and its error."""

    step: int | None = None
    error: str | None = None


def read_reports(store: dist.Store, nproc: int) -> dict[int, RankReport]:
    """Every rank's last report, read in the launcher from the store it hosts."""
    out = {}
    for rank in range(nproc):
        step, error = _get(store, _STEP_KEY.format(rank=rank)), _get(store, _ERROR_KEY.format(rank=rank))
        out[rank] = RankReport(int(step) if step is not None and step.isdigit() else None, error)
    return out


def _get(store: dist.Store, key: str) -> str | None:
    try:
        return store.get(key).decode("utf-8", "replace") if store.check([key]) else None
    except RuntimeError:
        return None
