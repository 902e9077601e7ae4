"""The loss-spike rule (`train.spike_factor`, `train.spike_window`).

A step whose loss exceeds `factor` times the median loss of the `window` steps before it is a
spike: the trainer does not apply its update, goes back to its last checkpoint and skips the
batches from there up to the spike (PaLM's remedy, Chowdhery et al. 2022, sec. 5.1: a spike comes
from a bad state meeting particular batches, and replaying other batches from an earlier state
avoids it). The median, not the mean, so that one spike does not raise the bar for the next.

The rule only judges once `window` earlier losses are known, and its history is part of the
trainer state of every checkpoint, so a resumed run judges exactly as the uninterrupted one. The
loss is the global batch's, the same number on every rank, so every rank decides alike.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

MAX_ROLLBACKS = 3  # roll-backs to one checkpoint before the run stops: spikes that other batches do not cure


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    median: float  # of the window before it
    factor: float


class LossSpikeRule:
    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self._history: deque[tuple[int, float]] = deque(maxlen=window)  # (step, loss) of applied steps

    def check(self, step: int, loss: float) -> Spike | None:
        """A Spike when `loss` (of `step`) is one, else None; a step that is not a spike joins the history.
        A loss that is not finite is left to train.skip_nonfinite and joins nothing."""
        if not loss == loss or loss in (float("inf"), float("-inf")):
            return None
        if len(self._history) == self.window:
            median = statistics.median(v for _, v in self._history)
            if loss > self.factor * median:
                return Spike(step, loss, median, self.factor)
        self._history.append((step, loss))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(x) for x in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(((int(s), float(v)) for s, v in state.get("history", [])), maxlen=self.window)
