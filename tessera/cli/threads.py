"""CPU threads that behave on a shared machine: the wait policy of the OpenMP pool, set before torch
loads.

torch's intra-op pool, and with it the project's C++ kernels (`at::parallel_for`), runs on OpenMP
(libgomp). By default a libgomp thread that runs out of work spins for about 300,000 iterations
before it sleeps, which on an idle machine saves a wake-up between two parallel regions and on a
busy one burns the time slices other processes wait for: a step that needs both cores spins
against every other runnable process, and slows by far more than its share of the cores
(issue 54: 3 s a step idle, 40-70 s at load 15). `GOMP_SPINCOUNT=10000` bounds the spin to a
thirtieth of that: short enough not to hold a core another process waits for, long enough to catch
the next parallel region of a step without a wake-up (`OMP_WAIT_POLICY=PASSIVE`, sleeping at once,
cost 14-21% of the idle step; the bounded spin 0-3%, and at load 8 it was as fast or faster:
docs/benchmarks.md). libgomp reads it when it loads, so `tessera` sets it at start, before any
command imports torch, unless the user has chosen a policy (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`
set, to any value). A program that imports Tessera as a library keeps its own
environment. bench/shared_cpu.py measures the step time idle and under load with each policy
(docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

WAIT_POLICY = {"GOMP_SPINCOUNT": "10000"}
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_thread_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the bounded-spin wait policy in `environ` (os.environ) unless the user chose one; returns what
    was set."""
    environ = os.environ if environ is None else environ
    if any(key in environ for key in USER_CHOICES):
        return {}
    environ.update(WAIT_POLICY)
    return dict(WAIT_POLICY)
