"""`tessera train` on a CPU keeps its intra-op thread count to the cores other processes leave free
(tessera/cli/adaptive_threads.py): the count chosen from the runnable tasks of others, the samples read
from /proc, and a real run beside busy processes whose count drops (metrics.jsonl's cpu_threads) while
its losses stay those of a run at the fixed count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tessera.cli import adaptive_threads as at
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_MOE, moe_shrink, set_args


@pytest.mark.parametrize("others, cores, configured, expected", [
    (0, 2, 2, 2), (0.4, 2, 2, 2), (0.5, 2, 2, 2), (0.75, 2, 2, 1), (1, 2, 2, 1), (6, 2, 2, 1), (0, 2, 1, 1),
    (0, 16, 4, 4), (13, 16, 8, 3), (12.5, 16, 8, 4), (40, 16, 8, 1)])
def test_the_count_is_the_cores_others_leave_free(others, cores, configured, expected):
    assert at.choose_threads(others, cores, configured) == expected


@pytest.fixture
def busy():
    """Two processes that keep a core busy each, until the test ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_samples_count_other_processes_runnable_tasks_not_this_ones(busy, tmp_path):
    assert at.own_running_threads() >= 1  # the thread that asks is running
    deadline = time.monotonic() + HANG_S
    while (seen := at.others_runnable()) is not None and seen < len(busy):
        assert time.monotonic() < deadline, "the busy processes never showed as runnable"
    assert seen is not None and seen >= len(busy)
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 7/123 4567\n")
    assert at.runnable_tasks(tmp_path / "loadavg") == 7
    assert at.runnable_tasks(tmp_path / "missing") is None


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_choice_every_interval_from_the_mean_of_its_samples(two_threads):
    seen = iter([0, 1, 1, 1, 0, 0, 0, 1, 5, 5])
    # every step as long as every other (a still clock): the load alone decides
    policy = at.AdaptiveThreads(configured=2, cores=2, interval=2, sample=lambda: next(seen), clock=lambda: 0.0)
    counts = []
    for step in range(1, 11):
        policy(step)
        counts.append(torch.get_num_threads())
    # means per pair: 0.5 -> 2, 1 -> 1, 0 -> 2, 0.5 -> 2, 5 -> 1
    assert counts == [2, 2, 2, 1, 1, 2, 2, 2, 2, 1]
    assert policy.choices == [(4, 1), (6, 2), (10, 1)]
    none = at.AdaptiveThreads(configured=2, cores=2, interval=1, sample=lambda: None)  # no /proc: left alone
    none(1)
    assert torch.get_num_threads() == 1 and none.choices == []


def _run(policy: at.AdaptiveThreads, steps: int, seconds_at: dict[int, float], clock: list[float]) -> list[int]:
    """`steps` steps under `policy` (a choice every 4th call: the step it is made at runs at it), each
    taking `seconds_at[count]` of the fake clock: the counts they ran at."""
    counts = []
    for step in range(steps):
        policy(step)
        counts.append(torch.get_num_threads())
        clock[0] += seconds_at[torch.get_num_threads()]
    return counts


@pytest.mark.parametrize("seconds_at, expected", [
    # busy processes in another session: one thread is faster, kept
    ({2: 5.7, 1: 1.9}, [2] * 3 + [1] * 37),
    # busy processes in the run's own session: one thread is slower, back to two; tried again once the
    # measurement is older than `memory` (32 steps)
    ({2: 5.4, 1: 7.2}, [2] * 3 + [1] * 4 + [2] * 33)])
def test_a_count_whose_steps_are_measured_slower_is_left(two_threads, seconds_at, expected):
    clock = [0.0]
    policy = at.AdaptiveThreads(configured=2, cores=2, interval=4, sample=lambda: 6, clock=lambda: clock[0])
    assert _run(policy, 40, seconds_at, clock) == expected


def test_a_slower_count_measured_under_another_load_does_not_hold_the_choice(two_threads):
    clock, load = [0.0], [6]
    policy = at.AdaptiveThreads(configured=2, cores=2, interval=4, sample=lambda: load[0], clock=lambda: clock[0])
    assert _run(policy, 8, {2: 5.0, 1: 1.5}, clock) == [2] * 3 + [1] * 5  # two threads slower while busy
    load[0] = 0  # the machine is left idle: two threads are proposed and taken, their busy time notwithstanding
    assert _run(policy, 8, {2: 0.9, 1: 1.6}, clock) == [1] * 3 + [2] * 5


def test_installed_on_cpu_runs_that_start_with_several_threads(two_threads):
    assert [type(h) for h in at.thread_hooks(True, "cpu")] == [at.AdaptiveThreads]
    assert at.thread_hooks(False, "cpu") == [] and at.thread_hooks(True, "cuda") == []
    torch.set_num_threads(1)
    assert at.thread_hooks(True, "cpu") == []


def _train(small_dataset, run_dir, adaptive: bool) -> list[dict]:
    overrides = moe_shrink(small_dataset, run_dir, 7, **{"train.adaptive_threads": adaptive})
    done = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_MOE, *set_args(overrides)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"},
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) > 8, reason="loading every core of a machine of more than 8 takes too much")
def test_a_run_beside_busy_processes_drops_to_one_thread_with_the_same_losses(small_dataset, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:  # as many busy processes as cores: no core is free, whatever else runs
        adaptive = _train(small_dataset, tmp_path / "adaptive", True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    fixed = _train(small_dataset, tmp_path / "fixed", False)
    assert [r["step"] for r in adaptive] == [r["step"] for r in fixed] == list(range(1, 8))
    assert [r["cpu_threads"] for r in fixed] == [2] * 7
    assert [r["cpu_threads"] for r in adaptive] == [2, 2, 2, 1, 1, 1, 1]  # chosen at step 4, from 4 samples
    assert [r["loss"] for r in adaptive] == pytest.approx([r["loss"] for r in fixed], abs=1e-5)
