"""Turn a collective that never completed into an error that names the rank, the phase and the operation.

Every process group gets a timeout (`train.collective_timeout_s`); when a peer never joins a
collective, gloo raises "Timed out waiting N ms for recv operation to complete" and NCCL's
watchdog reports the work item. Neither names what the training loop was doing. `CollectivePhase`
wraps one phase of a step ("forward/backward", "gradient norm", "checkpoint save", ...) and
re-raises such a failure as a `ParallelError`:

    rank 0 of 2: a collective did not complete within train.collective_timeout_s=30 s during
    forward/backward (operation: all_reduce in tessera/parallel/data_parallel_batch.py:global_sum) ...

The operation is read off the traceback: the innermost frame inside `torch.distributed` is the
collective that was waiting (`all_reduce`, `all_gather_single`, `wait_tensor`, ...), and the
innermost frame outside torch says who called it.

A peer that ends under a collective (killed, failed, stopped by its launcher) shows up at once instead,
as gloo's "Connection reset by peer" / "Connection closed by peer" or a broken pipe: a consequence in
this rank, whose cause the launcher names (tessera.parallel.jobs.restarts). It becomes a one-line
`TrainingError` saying so (`lost_peer`), not a traceback in the job's output.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from tessera.config.errors import ParallelError, TesseraError, TrainingError

_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog")
# Error text of a rank that failed only because a peer died or hung under a collective (gloo, the
# store, the collective timeout, `lost_peer`'s own line): such a rank is a consequence, not the cause.
PEER_FAILURE_MARKERS = ("connection closed", "connection reset", "broken pipe", "connection refused",
                        "socket closed", "did not complete within", "another rank of the job ended")
_PEER_LOSS_MARKERS = PEER_FAILURE_MARKERS[:5]
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_TORCH = os.sep + "torch" + os.sep


def is_collective_timeout(error: BaseException) -> bool:
    """Whether `error` is a process group's timeout (gloo, NCCL or the store)."""
    if not isinstance(error, RuntimeError):  # DistBackendError, DistStoreError are RuntimeErrors
        return False
    text = str(error).lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS)


def waiting_operation(error: BaseException) -> str:
    """'OPERATION in CALLER' from the traceback of a failed collective ('unknown' if not found)."""
    frames = traceback.extract_tb(error.__traceback__)
    op = next((f.name for f in reversed(frames) if _TORCH_DISTRIBUTED in f.filename
               and not f.name.startswith("_") and f.name not in ("wrapper", "wait")), None)
    caller = next((f for f in reversed(frames) if _TORCH not in f.filename), None)
    where = f"{os.path.relpath(caller.filename)}:{caller.name}" if caller is not None else "unknown caller"
    return f"{op or 'unknown'} in {where}"


def lost_peer(error: BaseException, rank: int, world_size: int, phase: str | None = None) -> TrainingError | None:
    """The one-line error of a rank whose collective failed because a peer ended (None: `error` is not
    that, or this is a job of one rank)."""
    if world_size <= 1 or not isinstance(error, RuntimeError) or isinstance(error, TesseraError):
        return None
    if not any(marker in str(error).lower() for marker in _PEER_LOSS_MARKERS):
        return None
    first_line = " ".join(str(error).split())[:200]
    during = f" during {phase} (operation: {waiting_operation(error)})" if phase else ""
    return TrainingError(f"another rank of the job ended{during}, so rank {rank} of {world_size} stops too; the "
                         f"launcher's line names the cause. Backend said: {first_line}")


@contextmanager
def collective_phase(phase: str, rank: int, world_size: int, timeout_s: float) -> Iterator[None]:
    """Re-raise a collective timeout inside the block as a ParallelError naming rank, phase and operation."""
    try:
        yield
    except RuntimeError as e:
        peer = lost_peer(e, rank, world_size, phase)
        if peer is not None:
            raise peer from e
        if world_size <= 1 or not is_collective_timeout(e):
            raise
        first_line = " ".join(str(e).split())[:200]
        raise ParallelError(
            f"rank {rank} of {world_size}: a collective did not complete within "
            f"train.collective_timeout_s={timeout_s:g} s during {phase} (operation: {waiting_operation(e)}); "
            f"another rank is stuck, crashed or runs different code. Backend said: {first_line}") from e
