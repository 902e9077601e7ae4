"""What the planner reads from a run configuration: the model, the layout, the batch, the dtype and
the distillation teacher."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.plan.layout import Workload


@dataclass
class RunInputs:
    """What the planner reads from a run configuration."""

    model: ModelConfig
    parallel: ParallelConfig
    work: Workload
    dtype: str  # train.dtype
    teacher: str | None = None  # train.distill.teacher (a directory; its model is read by the caller)


def load_run_inputs(path: str, overrides: list[str] | None = None) -> RunInputs:
    """The model, layout and batch of a run configuration (`tessera.config.schema.load_config`)."""
    from tessera.config.schema import load_config

    cfg = load_config(path, overrides or [])
    t = cfg.train
    return RunInputs(model=cfg.model, parallel=cfg.parallel,
                     work=Workload(t.seq_len, t.micro_batch_size, t.global_batch_size), dtype=t.dtype,
                     teacher=t.distill.teacher)
