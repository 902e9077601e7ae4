"""Starting ranks and joining them into one process group.

Two ways in, one code path inside:

- `torchrun --nproc-per-node N -m tessera train CONFIG` (or srun + torchrun over nodes): torchrun
  sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT and hosts the rendezvous store.
- `tessera train CONFIG --nproc N`: `launch_local` plays torchrun's part on one machine. It hosts
  a TCPStore on 127.0.0.1 (on a port the OS picks, so no port can be taken in between), starts N
  copies of the command with the same variables (TORCHELASTIC_USE_AGENT_STORE=True tells every
  rank to join that store as a client, as under torchrun), forwards SIGTERM/SIGINT to them, and
  when one rank fails gives the others a short grace period before stopping them; with
  `max_restarts` it then starts them all again (tessera.parallel.jobs.restarts), each rank reporting its
  step and error to the store meanwhile (tessera.parallel.jobs.progress). A rank whose launcher dies
  (SIGKILL) stops as if it had received SIGTERM (`watch_launcher`).

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
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tessera.config.errors import ParallelError
from tessera.parallel.jobs.progress import PROGRESS_ENV, read_reports
from tessera.parallel.jobs.restarts import RankExit, RestartPolicy, failing_rank

# After a rank fails, its peers get this long to report their own error before they are stopped.
FAILURE_GRACE_S = 5.0
# A stopped rank that has not exited after SIGTERM for this long is killed.
KILL_AFTER_S = 10.0
# Set by `launch_local` in every rank it starts: the launcher's process id (see watch_launcher).
LAUNCHER_PID_ENV = "TESSERA_LAUNCHER_PID"
# How often the job's ranks were started again after a failure (0: first start); torchrun's name.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


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
    kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
    restart = restart_count()
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        # torchrun keeps one store for every attempt: without a prefix of its own, a restarted rank reads
        # the previous attempt's keys (a dead rank's address) and cannot connect (pytorch#167288).
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timedelta(seconds=timeout_s))
        kwargs["store"] = dist.PrefixStore(f"tessera/restart_{restart}", agent_store)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
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


def restart_count() -> int:
    """How often the launcher (ours or torchrun) has restarted this job's ranks; 0 for a first start."""
    value = os.environ.get(RESTART_COUNT_ENV, "0")
    return int(value) if value.isdigit() else 0


@dataclass
class _Job:
    """The ranks of the current attempt and the signals passed on to them."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)

    def forward(self, signum, frame) -> None:
        self.forwarded.append(signum)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def launch_local(nproc: int, command: Sequence[str], env: dict[str, str] | None = None, max_restarts: int = 0,
                 run_dir: str | os.PathLike | None = None) -> int:
    """Run `command` as `nproc` ranks of one job on this machine; returns the job's exit status.

    The status is 0 when every rank succeeded, else that of the rank that failed first (a rank
    stopped by the launcher after another failed does not count as the cause). SIGTERM / SIGINT
    are passed on to every rank, which stop after the same step with a checkpoint; the launcher
    waits for all of them (a second signal, passed on too, stops them at once).

    With `max_restarts` K > 0, an attempt that fails (not one stopped by a signal) starts all N
    ranks again, up to K times, unless it failed at the step the previous attempt failed at
    (tessera.parallel.jobs.restarts, which logs each restart and refusal under `run_dir`). The restarted
    ranks resume from the newest good checkpoint (they see TORCHELASTIC_RESTART_COUNT, as under
    torchrun); the job's status is that of its last attempt.
    """
    if nproc < 1:
        raise ParallelError(f"--nproc={nproc} is invalid: must be >= 1")
    base = {**os.environ, **(env or {})}
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    policy = RestartPolicy(max_restarts, nproc, run_dir)
    job = _Job()
    previous = {s: signal.signal(s, job.forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            status, failure = _run_attempt(nproc, command, base, policy.restarts, job)
            if failure is None or job.forwarded or not policy.restart_after(failure):
                return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_attempt(nproc: int, command: Sequence[str], base: dict[str, str], restart: int,
                 job: _Job) -> tuple[int, RankExit | None]:
    """Start every rank once and wait for them: (exit status, the failure that ended the attempt or None)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    job.procs = []
    for rank in range(nproc):
        rank_vars = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                     "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": str(True),
                     LAUNCHER_PID_ENV: str(os.getpid()), RESTART_COUNT_ENV: str(restart), PROGRESS_ENV: "1"}
        # Own session: a terminal's Ctrl-C reaches the launcher, which forwards it once.
        job.procs.append(subprocess.Popen(list(command), env={**base, **rank_vars}, start_new_session=True))
    failed: list[int] = []  # ranks in the order their failure was seen, before any was stopped
    try:
        first_failure_at = None
        # Every rank is polled each time (a list, not a short-circuiting `any` over a generator): a rank
        # that died is seen even while a rank before it waits in a collective for it.
        while None in [p.poll() for p in job.procs]:
            # Asked to stop, every rank finishes its step and saves: wait for all of them. Else a
            # failure gives the other ranks FAILURE_GRACE_S to report their own before they are stopped.
            if not job.forwarded:
                failed += [r for r, p in enumerate(job.procs) if p.returncode not in (None, 0) and r not in failed]
                if failed and first_failure_at is None:
                    first_failure_at = time.monotonic()
                elif first_failure_at is not None and time.monotonic() - first_failure_at > FAILURE_GRACE_S:
                    break
            time.sleep(0.05)
        if not job.forwarded:
            failed += [r for r, p in enumerate(job.procs) if p.returncode not in (None, 0) and r not in failed]
    finally:
        _stop(job.procs)
    reports = read_reports(store, nproc)
    del store
    if not failed:  # every rank succeeded, or stopped when asked to
        return next((_exit_status(p.returncode) for p in job.procs if p.returncode != 0), 0), None
    failure = failing_rank([RankExit(r, job.procs[r].returncode, reports[r].step, reports[r].error) for r in failed])
    return _exit_status(failure.returncode), failure


def _exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def module_command(module: str, args: Sequence[str]) -> list[str]:
    """`python -m MODULE ARGS` with this interpreter."""
    return [sys.executable, "-m", module, *args]
