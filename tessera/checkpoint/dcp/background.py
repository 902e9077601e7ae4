"""Checkpoints written in the background while training goes on (`checkpoint.async: true`).

`BackgroundSaver.start` copies the state to new CPU tensors (DCP's `BlockingAsyncStager`; a DTensor
keeps its placement, so each rank still writes only its shards) and returns; a thread then runs the
ordinary `store.save_checkpoint` on the copy. The checkpoint is therefore the directory a synchronous
save writes, with the same guarantees: written to `.tmp-step_N-PID/`, every file's CRC-32 in
meta.json, renamed into place, `latest` moved last; a process killed meanwhile leaves the previous
checkpoint and pointer as they were. The training step that follows changes the live tensors, never
the copy, so the checkpoint holds the state of the step it was started at.

At most one save is in flight: `start` waits for the previous save first, and `wait` (the trainer
calls it before a roll-back, an export and at the end of the run) returns once the save is complete
and re-raises its error. On several ranks the saves' collectives (DCP's planning, the checksum
gather, rank 0's verdict) run in a gloo process group of their own, made once by every rank: in one
group shared with the training loop, a background save's broadcast could be paired with a training
all-reduce of another rank.

This is DCP's `async_save` with a thread executor, done here so that the completion (meta.json,
rename, pointer) happens in the same thread, after the files are written and hashed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from tessera.checkpoint.dcp.store import save_checkpoint, step_dir_name


class BackgroundSaver:
    """One checkpoint save at a time, written by a background thread from a CPU copy of the state."""

    def __init__(self, distributed: bool):
        # Every rank calls this at the same point (new_group is collective over the default group).
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written (None: no save is running or waiting to be collected)."""
        return self._path if self._thread is not None else None

    @property
    def writing(self) -> bool:
        """Whether the thread is still writing (a finished save waits for `wait` to be collected)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> Path:
        """Wait for the previous save, copy `state` to CPU memory and write it as checkpoint `step` in the
        background; returns the directory it will have (complete once `wait` returns)."""
        self.wait()
        staged = BlockingAsyncStager(cache_staged_state_dict=False).stage(state)
        self._path = Path(root) / step_dir_name(step)

        def write() -> None:
            try:
                save_checkpoint(root, step, staged, meta, keep_last, group=self.group)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=write, name=f"tessera-checkpoint-{step}", daemon=True)
        self._thread.start()
        return self._path

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; its directory (None: there was none). Raises the
        save's error (CheckpointError when it could not be written; the previous checkpoint is intact)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._path
