"""Per-rank step and wait times, and the slowest rank (`log.straggler_threshold`).

Each rank times its steps (from the batch to the agreement on a stop signal that ends the step) and,
within them, how long it waited at the step's synchronisation points, the collectives every rank
joins at a fixed place of the step: the check-in after the batch is read (`RunLayout.check_in`), the
gradient norm's all-reduce after the backward, and the stop agreement after the update. A rank that
reaches one of them early waits there for the last one; the last one hardly waits. So a rank's own
work in a step is its step time less its wait, and the slowest rank is the one with the most.

At each metrics line the ranks' figures since the previous line are gathered (one all-gather) into

    rank_step_s      [seconds per step of rank 0, rank 1, ...]
    rank_wait_s      [seconds per step each rank waited at the synchronisation points]
    straggler_rank   the slowest rank, when its own work exceeds the median rank's by more than
    straggler_lag_s  log.straggler_threshold x the median step time; the lag in seconds per step

What a rank makes up inside the forward and backward's own collectives (FSDP's all-gathers, tensor
parallelism's all-reduces, a pipeline's sends) is waited for there, by every rank alike, and is not
counted as anyone's wait: the check-in still shows a rank that is slow to read its batch or to end
its step, the gradient norm one slow in its last backward, the agreement one slow in its update.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


class RankTiming:
    """This rank's step and wait seconds since the last metrics line, and the gathering of everyone's."""

    def __init__(self, rank: int, world_size: int, threshold: float):
        self.rank, self.world_size, self.threshold = rank, world_size, threshold
        self.step_s = self.wait_s = 0.0
        self.steps = 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's time as waiting at a synchronisation point."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    def step_done(self, seconds: float) -> None:
        self.step_s += seconds
        self.steps += 1

    def gather(self) -> dict[str, Any]:
        """Every rank's seconds per step since the last call (a collective), the straggler when one lags."""
        mine = torch.tensor([self.step_s, self.wait_s, float(self.steps)], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        self.step_s = self.wait_s = 0.0
        self.steps = 0
        steps = [float(t[0]) / max(float(t[2]), 1.0) for t in everyone]
        waits = [float(t[1]) / max(float(t[2]), 1.0) for t in everyone]
        out: dict[str, Any] = {"rank_step_s": [round(s, 6) for s in steps], "rank_wait_s": [round(w, 6) for w in waits]}
        straggler = slowest_rank(steps, waits, self.threshold)
        if straggler is not None:
            out["straggler_rank"], out["straggler_lag_s"] = straggler[0], round(straggler[1], 6)
        return out


def slowest_rank(steps: list[float], waits: list[float], threshold: float) -> tuple[int, float] | None:
    """(rank, lag in seconds) of the rank whose own work (step - wait) exceeds the median rank's by more
    than `threshold` x the median step time; None when no rank lags that much."""
    own = [s - w for s, w in zip(steps, waits, strict=True)]
    rank = max(range(len(own)), key=own.__getitem__)
    lag = own[rank] - statistics.median(own)
    return (rank, lag) if lag > threshold * statistics.median(steps) else None
