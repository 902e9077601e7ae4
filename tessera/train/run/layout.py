"""Where this process sits in a run: rank, world, device and, on several ranks, the named device mesh.

`build_layout(cfg)` joins the process group the launcher prepared (torchrun, `tessera train
--nproc N`, or one the caller already initialised, as the test harness does), then checks the
`parallel` section against the world size and the model's shapes before any weight is allocated,
and builds the mesh. A job of one rank (`--nproc 1`, `torchrun --nproc-per-node 1`) is a layout
too, in a process group of one. With one process (no launcher) there is no process group and no
mesh: the trainer then runs the single-process step.

Rank 0 is the coordinator: it alone writes metrics.jsonl, config.yaml, TensorBoard events, the
progress bar and the checkpoint directory's bookkeeping; every rank reads the same global batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tessera.config.devices import resolve_device
from tessera.config.errors import ConfigError, TesseraError
from tessera.config.schema import RunConfig
from tessera.parallel.dims import ParallelDims
from tessera.parallel.jobs.collective_timeout import collective_phase
from tessera.parallel.jobs.launch import init_distributed, rank_env, set_default_timeout
from tessera.parallel.pipeline import ROUND_SCHEDULES, schedule_accepts_microbatches

__all__ = ["ROUND_SCHEDULES", "RunLayout", "build_layout", "check_batch_layout", "resolve_device",
           "schedule_accepts_microbatches"]

T = TypeVar("T")


def _take_device(name: str) -> torch.device:
    """The resolved `train.device` as a torch device, made this process's current GPU when it names one."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


@dataclass
class RunLayout:
    rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims | None  # None for one process
    timeout_s: float
    backend: str | None = None  # the process group's ("gloo", "cuda:nccl,cpu:gloo"); None for one process

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size if self.dims is not None else 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a pickled object broadcast)."""
        if not self.distributed:
            return obj
        box = [obj]
        with self.phase("broadcast from rank 0"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_coordinator(self, fn: Callable[[], T]) -> T | None:
        """`fn()` on rank 0 only (None elsewhere). If it raises, every rank raises (the others a
        copy naming rank 0) instead of waiting for rank 0 in the next collective until the timeout."""
        if not self.distributed:
            return fn()
        result, error = None, None
        if self.is_coordinator:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
        failed = self.broadcast(None if error is None else (type(error), " ".join(str(error).split())))
        if error is not None:
            raise error
        if failed is not None:
            cls, message = failed
            if issubclass(cls, TesseraError):
                raise cls(f"on rank 0: {message}")
            raise RuntimeError(f"rank 0 failed with {cls.__name__}: {message}")
        return result

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's `value` (e.g. a stop signal only some ranks received)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        with self.phase("agreeing on a stop signal"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def check_in(self) -> None:
        """Every rank reaches this point (a one-number all-reduce): where a rank that is late shows as the
        others' wait (tessera.train.run.rank_timing)."""
        if self.distributed:
            with self.phase("step check-in"):
                dist.all_reduce(torch.zeros(1, dtype=torch.int64))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A collective timeout inside the block becomes a ParallelError naming rank, phase, operation."""
        with collective_phase(name, self.rank, self.world_size, self.timeout_s):
            yield


def check_batch_layout(cfg: RunConfig, dims: ParallelDims) -> None:
    """The global batch must split into equal micro-batches on every data-parallel rank, in a count
    the pipeline schedule accepts. With pp > 1, `parallel.microbatches` may cut a rank's rows into
    micro-batches of another size than `train.micro_batch_size`, for MoE models too: their
    auxiliary losses and expert capacity are then those of the pipeline's micro-batches (the
    convention of Megatron-Core), as in one process with micro-batches of that size."""
    t, dp = cfg.train, dims.dp_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is invalid: must be a multiple of "
                          f"train.micro_batch_size x data-parallel size (dp_replicate x dp_shard) = "
                          f"{t.micro_batch_size} x {dp}")
    if dims.pp == 1:
        if cfg.parallel.microbatches is not None:
            raise ConfigError(f"parallel.microbatches={cfg.parallel.microbatches} is invalid: parallel.microbatches "
                              f"only applies with parallel.pp > 1 (here parallel.pp=1); the number of "
                              "micro-batches is global_batch_size / (micro_batch_size x data-parallel size) = "
                              f"{t.global_batch_size} / ({t.micro_batch_size} x {dp}); leave it unset")
        return
    rows = t.global_batch_size // dp
    derived = rows // t.micro_batch_size
    m = cfg.parallel.microbatches
    if m is not None and rows % m:
        raise ConfigError(f"parallel.microbatches={m} is invalid: it must divide the {rows} samples each "
                          f"data-parallel rank reads (train.global_batch_size / dp = {t.global_batch_size} / {dp})")
    m = m or derived
    schedule = cfg.parallel.pp_schedule
    given = (f"parallel.microbatches={m}" if cfg.parallel.microbatches is not None else
             f"parallel.microbatches unset: train.global_batch_size / dp / train.micro_batch_size = "
             f"{t.global_batch_size} / {dp} / {t.micro_batch_size}")
    if m < dims.pp and schedule != "gpipe":
        raise ConfigError(f"{m} micro-batches per data-parallel rank ({given}) are fewer than parallel.pp="
                          f"{dims.pp}: the {schedule} schedule needs one per stage; lower "
                          "train.micro_batch_size or raise train.global_batch_size")
    if not schedule_accepts_microbatches(schedule, m, dims.pp):
        fits = [d for d in range(1, rows + 1) if rows % d == 0 and schedule_accepts_microbatches(schedule, d, dims.pp)]
        choice = f"parallel.microbatches in {fits}" if fits else "none divides them: change train.global_batch_size"
        raise ConfigError(f"{m} micro-batches per data-parallel rank ({given}) are invalid for "
                          f"parallel.pp_schedule={schedule} with parallel.pp={dims.pp}: the schedule runs "
                          f"m // pp = {m // dims.pp} rounds of equal size, so m must be in [pp, 2 pp) or a "
                          f"multiple of m // pp; for the {rows} samples of each data-parallel rank that "
                          f"allows {choice}")


def build_layout(cfg: RunConfig) -> RunLayout:
    """Join the process group (if any), validate the parallel layout and build the mesh."""
    t = cfg.train
    env = rank_env()
    device = _take_device(resolve_device(t.device, env.local_rank if env.distributed else None, "train.device"))
    env = init_distributed(device, t.collective_timeout_s)
    if not env.distributed:
        cfg.parallel.resolved_dp_shard(1)  # one process: refuse a layout that needs several ranks
        return RunLayout(0, 1, device, None, t.collective_timeout_s)
    dims = ParallelDims.from_config(cfg.parallel, env.world_size)
    dims.validate(cfg.model, env.world_size, seq_len=t.seq_len, vpp=cfg.parallel.stages_per_rank)
    check_batch_layout(cfg, dims)
    set_default_timeout(t.collective_timeout_s)  # the mesh's subgroups take it
    layout = RunLayout(env.rank, env.world_size, device, dims, t.collective_timeout_s, str(dist.get_backend()))
    with layout.phase("building the device mesh"):
        dims.build_mesh(device.type)
    return layout
