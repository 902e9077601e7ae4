"""Graceful stop on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit.

Schedulers (Slurm, Kubernetes) send SIGTERM some time before killing a job, and Ctrl-C sends
SIGINT; either sets a flag the training loop checks after every step. A second signal of the
same kind while the first is being handled falls back to the default behaviour (stop now).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager that turns SIGTERM and SIGINT into a `requested` flag."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one stops at once

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # handlers only work there
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class AgreedStop:
    """Whether the training loop stops after the current step. In one process: as soon as a
    signal arrived. On several ranks (`max_over_ranks` given): after the step at whose end any rank
    had received one, so that every rank stops after the same step; `agree` (called by every rank
    after every step) takes the largest signal number over the ranks."""

    def __init__(self, signal: StopSignal, max_over_ranks: Callable[[int], int] | None = None):
        self.signal, self._max_over_ranks = signal, max_over_ranks
        self._agreed: int | None = None

    def agree(self) -> None:
        if self._max_over_ranks is not None:
            self._agreed = self._max_over_ranks(self.signal.received or 0) or None

    @property
    def received(self) -> int | None:
        """The signal number the run stops for (None: none)."""
        return self._agreed if self._max_over_ranks is not None else self.signal.received

    @property
    def requested(self) -> bool:
        return self.received is not None
