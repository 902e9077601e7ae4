"""Starting ranks and joining them into one process group.

Two ways in, one code path inside:

- `torchrun --nproc-per-node N -m tessera train CONFIG` (or srun + torchrun over nodes): torchrun
  sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT and hosts the rendezvous store.
- `tessera train CONFIG --nproc N`: `launch_local` plays torchrun's part on one machine. It hosts
  a TCPStore on 127.0.0.1 (on a port the OS picks, so no port can be taken in between), starts N
  copies of the command with the same variables (TORCHELASTIC_USE_AGENT_STORE=True tells every
  rank to join that store as a client, as under torchrun), forwards SIGTERM/SIGINT to them, and
  when one rank fails gives the others a short grace period before stopping them. A rank whose
  launcher dies (SIGKILL) stops as if it had received SIGTERM (`watch_launcher`).

Either way each rank calls `init_distributed`, which reads the environment (env:// rendezvous)
and creates the default process group, for a job of one rank too (`--nproc 1`): gloo on CPU; on
CUDA, NCCL for CUDA tensors and gloo for CPU ones. Every group, including the device mesh's
subgroups created later, times out after `timeout_s`, so a hung collective becomes an error
(collective_timeout.py names the rank and the operation).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tessera.config.errors import ParallelError

# After a rank fails, its peers get this long to report their own error before they are stopped.
FAILURE_GRACE_S = 5.0
# A stopped rank that has not exited after SIGTERM for this long is killed.
KILL_AFTER_S = 10.0
# Set by `launch_local` in every rank it starts: the launcher's process id (see watch_launcher).
LAUNCHER_PID_ENV = "TESSERA_LAUNCHER_PID"


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, from the launcher's environment variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # Started as a rank of a job (its rendezvous variables are set), a job of one rank included:
    # `--nproc 1` and `torchrun --nproc-per-node 1` run in a process group like any other job.
    launched: bool = False

    @property
    def distributed(self) -> bool:
        """Whether this process is (or joins) a rank of a process group."""
        return self.world_size > 1 or self.launched


def rank_env() -> RankEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun (and `launch_local`) set them; one process without them
    (a WORLD_SIZE of 1 without MASTER_ADDR / MASTER_PORT, the launcher's rendezvous, too)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ParallelError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from e
    if not 0 <= rank < max(world, 1):
        raise ParallelError(f"RANK={rank} is invalid for WORLD_SIZE={world}: must be in [0, {world})")
    launched = "WORLD_SIZE" in os.environ and all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT"))
    return RankEnv(rank, world, local, launched)


def set_default_timeout(timeout_s: float) -> None:
    """Make every process group created from now on (mesh subgroups too) time out after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def init_distributed(device: torch.device, timeout_s: float) -> RankEnv:
    """Join the default process group from the environment (a no-op for one process or if it exists)."""
    env = rank_env()
    if dist.is_initialized():  # made by the caller (a test harness, a notebook): take its ranks,
        if hasattr(c10d, "_set_pg_timeout"):  # but make its default group time out like ours
            c10d._set_pg_timeout(timedelta(seconds=timeout_s))
        return RankEnv(dist.get_rank(), dist.get_world_size(), env.local_rank, launched=True)
    if not env.distributed:
        return env
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ParallelError(f"WORLD_SIZE={env.world_size} but {', '.join(missing)} is not set; start ranks "
                            "with `tessera train --nproc N` or torchrun")
    set_default_timeout(timeout_s)
    watch_launcher()
    # On GPUs, CUDA tensors go over NCCL and the small CPU tensors of bookkeeping (loss sums, token
    # counts, pickled objects) over gloo: one default group with both backends.
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return env


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def watch_launcher(poll_s: float = 1.0) -> None:
    """In a rank started by `launch_local`: SIGTERM this process once if the launcher dies (killed,
    say), so that the rank stops after its step with a checkpoint instead of training on alone.

    (The kernel's parent-death signal is not used: it fires again for every thread of a
    multi-threaded launcher that exits, and a second SIGTERM means "stop now" to the trainer.)"""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not launcher.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tessera-launcher-watch", daemon=True).start()


def _stop(procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + KILL_AFTER_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_local(nproc: int, command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run `command` as `nproc` ranks of one job on this machine; returns the job's exit status.

    The status is 0 when every rank succeeded, else that of the rank that failed first (a rank
    stopped by the launcher after another failed does not count as the cause). SIGTERM / SIGINT
    are passed on to every rank, which stop after the same step with a checkpoint; the launcher
    waits for all of them (a second signal, passed on too, stops them at once).
    """
    if nproc < 1:
        raise ParallelError(f"--nproc={nproc} is invalid: must be >= 1")
    store = dist.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    base = {**os.environ, **(env or {})}
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    procs = []
    for rank in range(nproc):
        rank_vars = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                     "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": str(True),
                     LAUNCHER_PID_ENV: str(os.getpid())}
        # Own session: a terminal's Ctrl-C reaches the launcher, which forwards it once.
        procs.append(subprocess.Popen(list(command), env={**base, **rank_vars}, start_new_session=True))

    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure: tuple[float, int] | None = None
        while any(p.poll() is None for p in procs):
            if forwarded:  # asked to stop: every rank finishes its step and saves; wait for all of them
                pass
            elif first_failure is None:
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed:
                    first_failure = (time.monotonic(), failed[0])
            elif time.monotonic() - first_failure[0] > FAILURE_GRACE_S:
                _stop(procs)
                break
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)
        del store
    if first_failure is not None:
        return _exit_status(first_failure[1])
    return next((_exit_status(p.returncode) for p in procs if p.returncode != 0), 0)


def _exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def module_command(module: str, args: Sequence[str]) -> list[str]:
    """`python -m MODULE ARGS` with this interpreter."""
    return [sys.executable, "-m", module, *args]
