"""The intra-op thread count of a CPU training run, kept to the cores that other processes leave free.

The bounded spin (threads.py) keeps a waiting thread from holding a core, but a step that splits each
operation over two threads still ends every parallel region by waiting for the slower of them, and on
a busy machine one of the two is often the one the scheduler has set aside. A program that behaves on
a shared machine uses only the cores that are free: while other processes keep the cores busy, one
thread avoids every such wait and adds one runnable task fewer to the machine; when they leave, the
run takes its cores back. Every `interval` steps `AdaptiveThreads` takes the mean, over the steps since
its last choice, of the tasks other processes had runnable as each step began (the runnable count of
/proc/loadavg, the same as /proc/stat's procs_running, less this process's own running threads) and
sets `torch.set_num_threads(k)`, k the machine's cores less that mean, rounded: at least 1, at most the
count the run started with (OMP_NUM_THREADS, or torch's default). A run that started with one thread,
and a machine without /proc, keep their count.

The runnable count cannot say whose share a thread takes: Linux shares the cores between sessions
(autogroups) before threads, so beside busy processes of other sessions a second thread adds only waits
(one thread is faster), while beside busy processes of the run's own session it adds a share of the
cores (two are faster; bench/shared_cpu.py measures both placements). So each count's steps are timed
too (the median wall time of the steps of its last interval, kept with the count the load proposed
meanwhile) and, under the same proposal, a choice never moves to a count whose steps were measured
slower within the last `memory` steps, and moves back to one measured faster there: the load proposes,
the run's own step times decide, and a count measured slower is tried again once its measurement is
older than `memory`.

Only the count changes: the same operations on the same values, split over fewer threads, so the
results differ only as a thread count changes them (a reduction's partial sums: a run's losses agree
with a fixed count's within fp32 rounding, tests/cli/test_adaptive_threads.py).
`tessera train` installs it on CPU runs (`train.adaptive_threads`, on by default) as a step hook of
the Trainer, which calls it on the training thread as each step begins: torch's intra-op count is
the calling thread's. metrics.jsonl logs the count a step ran on as `cpu_threads`. bench/shared_cpu.py
measures the demo with each policy, idle and beside busy processes in either placement
(docs/benchmarks.md). Not known here: a cgroup's CPU quota (a container's `cpu.max`), which
/proc/loadavg does not show.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

CHOICE_INTERVAL = 4  # steps between two choices; each step adds one sample to the next choice's mean
MEMORY_STEPS = 32  # how long a count's measured step time keeps the choices off a slower count
SLOWER = 1.1  # a count's steps are "slower" when their median is more than 10% above the other's


def choose_threads(others: float, cores: int, configured: int) -> int:
    """The intra-op thread count when other processes keep `others` tasks runnable (a mean) on a machine
    of `cores` cores: the cores they leave free, rounded half up, at least 1, at most `configured`."""
    free = math.floor(cores - others + 0.5)
    return max(1, min(configured, free))


def runnable_tasks(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """The machine's runnable tasks now (threads running or waiting for a core), or None without /proc."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def own_running_threads(tasks: Path = Path("/proc/self/task")) -> int:
    """This process's threads that are running or runnable now (state R), the calling thread among them."""
    count = 0
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended while it was read
            continue
        count += state == "R"
    return count


def others_runnable() -> int | None:
    """Tasks of other processes runnable now: the machine's less this process's own (never below 0)."""
    total = runnable_tasks()
    return None if total is None else max(0, total - own_running_threads())


class AdaptiveThreads:
    """A step hook (`Trainer(step_hooks=[...])`): one sample and one step time as each step begins, and
    every `interval` steps the count `choose_threads` gives for their mean, unless the steps' own times
    say otherwise (`timed_choice`), set on the calling thread."""

    def __init__(self, configured: int, cores: int | None = None, interval: int = CHOICE_INTERVAL,
                 sample: Callable[[], int | None] = others_runnable, memory: int = MEMORY_STEPS,
                 clock: Callable[[], float] = time.perf_counter):
        self.configured = configured
        self.cores = cores if cores is not None else (os.cpu_count() or 1)  # what /proc/loadavg counts over
        self.interval = interval
        self.sample = sample
        self.memory = memory
        self.clock = clock
        self.samples: list[int] = []
        self.times: list[float] = []  # wall seconds of the steps since the last choice, all at one count
        self.last: float | None = None
        # (count, the count the load proposed meanwhile) -> (median step seconds, the step it was measured at)
        self.measured: dict[tuple[int, int], tuple[float, int]] = {}
        self.choices: list[tuple[int, int]] = []  # (step, count) where the count changed

    def __call__(self, step: int) -> None:
        import torch

        now = self.clock()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now
        seen = self.sample()
        if seen is None:
            return
        self.samples.append(seen)
        if len(self.samples) < self.interval:
            return
        current = torch.get_num_threads()
        proposed = choose_threads(sum(self.samples) / len(self.samples), self.cores, self.configured)
        if self.times:
            self.measured[current, proposed] = (statistics.median(self.times), step)
        k = self.timed_choice(proposed, current, step)
        self.samples.clear()
        self.times.clear()
        if k != current:
            torch.set_num_threads(k)
            self.choices.append((step, k))

    def timed_choice(self, proposed: int, current: int, step: int) -> int:
        """`proposed`, unless a count's steps measured within `memory` steps under the same load (the
        same proposal) say otherwise: never a count measured slower than the current one, and back to a
        count measured faster than it."""
        fresh = {k: t for (k, p), (t, at) in self.measured.items() if p == proposed and step - at <= self.memory}
        now = fresh.get(current)
        if now is None:
            return proposed
        if proposed != current and fresh.get(proposed, 0.0) > now * SLOWER:
            return current
        faster = [k for k, t in fresh.items() if k != current and t * SLOWER < now]
        return min(faster, key=fresh.__getitem__) if proposed == current and faster else proposed


def thread_hooks(enabled: bool, device_type: str) -> list[Callable[[int], None]]:
    """The step hooks of `tessera train`'s thread policy: `AdaptiveThreads` on a CPU run when
    `train.adaptive_threads` is on and the run starts with more than one intra-op thread; else none."""
    if not enabled or device_type != "cpu":
        return []
    import torch

    configured = torch.get_num_threads()
    return [AdaptiveThreads(configured)] if configured > 1 else []
