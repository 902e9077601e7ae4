"""Run a function on N forked ranks over gloo: the multi-process test harness.

Starting ranks with torchrun or `multiprocessing.spawn` costs 5-10 s (a fresh interpreter imports
torch each time). Here the parent, which has already imported torch and torch.distributed, forks
the ranks: each child inherits the imports and is ready in milliseconds. Rendezvous is a
`FileStore` in a temporary directory, so no port is ever opened for it.

Every rank runs with one intra-op thread (two cores shared by eight threads run ten times slower)
and every process group it creates, including the device mesh's subgroups, gets the harness
timeout, so a hang fails the call instead of blocking CI. The parent also enforces the deadline
and kills ranks that outlive it. A rank's exception comes back as `RankFailure` naming the rank
and carrying its traceback; a rank's return value comes back through a file (torch.save), so it
may hold tensors.

    results = run_ranks(my_test_body, 2, "tiny-llama")  # my_test_body("tiny-llama") on 2 ranks

A forked child cannot use CUDA once its parent has initialised it ("Cannot re-initialize CUDA in
forked subprocess"), and autograd's device threads do not survive a fork either (they start at a
process's first backward when a CUDA device is visible: tests/conftest.py runs that backward with
the GPUs hidden). So the parent must never touch CUDA (tests pin `train.device=cpu`); if it has,
`run_ranks` refuses at once with
`CudaInitializedError` instead of letting every rank fail obscurely. Tests that need CUDA spawn
their processes instead (tests/gpu).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.tensor  # noqa: F401  (imported before fork so ranks start warm)
import torch.distributed.tensor.parallel  # noqa: F401
from torch.distributed.fsdp import fully_shard  # noqa: F401

# A failing rank's peers are blocked in a collective; give them this long to report their own
# error (often more telling) before they are killed.
PEER_GRACE_S = 1.0
# The parent's deadline is the process-group timeout plus this, so that a rank stuck in a
# collective fails with its own traceback before the parent kills what is left.
DEADLINE_MARGIN_S = 2.0


class CudaInitializedError(RuntimeError):
    """The parent process initialised CUDA, so it must not fork ranks."""


class RankFailure(AssertionError):
    """A rank raised, crashed or timed out. `rank` is the rank that failed first (None on timeout);
    the message holds every failed rank's traceback, the first one first."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _rank_main(workdir: str, rank: int, world_size: int, timeout_s: float,
               fn: Callable[..., Any], args: tuple, kwargs: dict) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    # Subgroups created without an explicit timeout (DeviceMesh dims, new_group) take this default.
    c10d.default_pg_timeout = timeout
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(*args, **kwargs)
        torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
        dist.destroy_process_group()
        return 0
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        with open(os.path.join(workdir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        return 1


def _fork_rank(workdir: str, rank: int, world_size: int, timeout_s: float, fn, args, kwargs) -> int:
    pid = os.fork()
    if pid != 0:
        return pid
    _compile_in_this_process()
    code = 1
    try:
        code = _rank_main(workdir, rank, world_size, timeout_s, fn, args, kwargs)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never return into the parent's code (pytest) in the child


def _compile_in_this_process() -> None:
    """torch.compile in a forked rank compiles in the rank itself: the parent's inductor worker pool
    (threads or processes started before the fork) does not exist in the child, so a job handed to
    it would never finish and the rank would hang until its deadline."""
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.compile_threads = 1
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def _failure_time(workdir: str, rank: int) -> int:
    path = os.path.join(workdir, f"error_{rank}.txt")
    return os.stat(path).st_mtime_ns if os.path.exists(path) else 2**63


def _read_error(workdir: str, rank: int, status: int) -> str:
    path = os.path.join(workdir, f"error_{rank}.txt")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.WEXITSTATUS(status)} without a traceback"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              **kwargs: Any) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` forked gloo ranks; return their results by rank.

    Inside `fn` the default process group is initialised (`dist.get_rank()` works); every process
    group times out after `timeout` seconds. Raises `RankFailure` if a rank raises or dies, or
    if the run outlives `timeout` + DEADLINE_MARGIN_S seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: must be >= 1")
    if torch.cuda.is_initialized():
        raise CudaInitializedError(
            "run_ranks forks its ranks, but this process has already initialised CUDA, which a forked "
            "child cannot use: run the parent on CPU only (train.device=cpu, models and tensors on cpu) "
            "before calling run_ranks, or start the processes with spawn (mark the test `gpu`)")
    workdir = tempfile.mkdtemp(prefix="tessera-ranks-")
    sys.stdout.flush()
    sys.stderr.flush()
    # The ranks never collect the parent's objects: collected here first, the survivors frozen
    # (gc.freeze) while forking. A child that garbage-collected what a parent left behind after
    # serving on a process group (its torch.distributed and DTensor objects) crashed in the
    # collector now and then, in the middle of an unrelated collective.
    gc.collect()
    gc.freeze()
    try:
        pids = {_fork_rank(workdir, r, world_size, timeout, fn, args, kwargs): r for r in range(world_size)}
    finally:
        gc.unfreeze()
    status: dict[int, int] = {}  # rank -> wait status
    deadline = time.monotonic() + timeout + DEADLINE_MARGIN_S
    first_failure: float | None = None
    try:
        while len(status) < world_size:
            now = time.monotonic()
            for pid, rank in list(pids.items()):
                if rank in status:
                    continue
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = st
                    if st != 0 and first_failure is None:
                        first_failure = now
            if first_failure is not None and now - first_failure > PEER_GRACE_S:
                break
            if now > deadline:
                break
            time.sleep(0.002)
    finally:
        for pid, rank in pids.items():
            if rank not in status:
                os.kill(pid, signal.SIGKILL)
                _, status[rank] = os.waitpid(pid, 0)
                status[rank] = -1  # marks "killed by the harness"
    try:
        failed = sorted((r for r, st in status.items() if st not in (0, -1)),
                        key=lambda r: (_failure_time(workdir, r), r))  # the first to fail caused the rest
        if failed:
            reports = "\n".join(f"--- rank {r} ---\n{_read_error(workdir, r, status[r])}" for r in failed)
            raise RankFailure(f"rank {failed[0]} of {world_size} failed:\n{reports}", rank=failed[0])
        hung = sorted(r for r, st in status.items() if st == -1)
        if hung:
            limit = timeout + DEADLINE_MARGIN_S
            raise RankFailure(f"ranks {hung} of {world_size} did not finish within {limit} s (killed)")
        return [torch.load(os.path.join(workdir, f"result_{r}.pt"), weights_only=False)
                for r in range(world_size)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
