"""The run directory (`run_dir`): which checkpoint a run resumes from, and what rank 0 writes
there when training starts (config.yaml, metrics.jsonl, TensorBoard events).

Rank 0 alone looks at and writes the directory; every other rank follows its decision and fails
with it if it fails (RunLayout.on_coordinator). Before anything, rank 0 locks the directory
(tessera.checkpoint.dcp.run_lock): a second trainer on it is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.run_lock import RunDirLock
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.schema import RunConfig, save_config
from tessera.train.run.layout import RunLayout
from tessera.train.run.metrics_writer import MetricsWriter

CHECKPOINT_DIR = "checkpoints"  # under run_dir


def checkpoint_to_resume(layout: RunLayout, run_lock: RunDirLock, run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None: start fresh), as rank 0 decides it for every rank.

    Leftovers of an interrupted save are cleaned up first: a crash while a step was saved again
    leaves that step's complete checkpoint under `.old-step_N-PID` (dcp.remove_partial_saves puts
    it back), and the step to resume from must be chosen after it is back in place. The checkpoint
    resumed from is the newest whose files match their checksums; each newer damaged one is named
    on stderr, with the file that is wrong. Without `resume`, a directory that already holds
    checkpoints is refused."""
    root = run_dir / CHECKPOINT_DIR

    def decide() -> tuple[str | None, str | None]:
        run_lock.acquire()
        ckpt.remove_partial_saves(root)
        found = ckpt.find_latest(root)
        if resume and found is not None:
            found, damaged = ckpt.find_latest_good(root)
            if found is None:
                raise CheckpointError(f"no usable checkpoint in {str(root)!r} to resume from: " + "; ".join(damaged))
            for line in damaged:
                print(f"warning: {line}; resuming from {found.name} instead", file=sys.stderr)
        if not resume and found is not None:
            return (None, f"run_dir={str(run_dir)!r} already holds checkpoints; pass --resume to "
                          "continue that run, or choose another run_dir")
        return (str(found) if resume and found is not None else None, None)

    # on_coordinator: the other ranks wait for the cleanup (and fail with rank 0 if it fails).
    found, error = layout.broadcast(layout.on_coordinator(decide))
    if error is not None:
        raise ConfigError(error)
    return Path(found) if found is not None else None


def open_metrics(layout: RunLayout, cfg: RunConfig, resume_step: int | None) -> MetricsWriter | None:
    """Rank 0 creates the directory, writes config.yaml and opens the metrics (a resumed run drops
    lines after `resume_step`); the other ranks wait for it and get None."""

    def prepare() -> MetricsWriter:
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        return MetricsWriter(run_dir, cfg.log.tensorboard, resume_step=resume_step)

    return layout.on_coordinator(prepare)
