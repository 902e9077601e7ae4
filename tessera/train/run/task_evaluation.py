"""`train.eval_tasks`: benchmark tasks at each evaluation, on the whole model of that step.

The trainer cannot serve a model itself (the serving engine and the task harnesses are layers
above it), so the caller hands it a `TaskEvaluator` (`tessera train` passes
`tessera.eval.training.TrainingTasks`): given the whole model, on rank 0, it returns the tasks'
metrics. What this module does is give it that model under any layout: every rank turns its
parts' DTensor shards into whole tensors (`full_tensor`, a collective over each tensor's mesh, in
the same order on every rank of a pipeline stage), the first rank of each pipeline stage sends its
stage's tensors to rank 0, and rank 0 builds a fresh `Transformer` from them on the training
device, in fp32. The training modules are not touched (the evaluator may put its own in eval mode,
hook or wrap it). While rank 0 evaluates, the other ranks wait for its outcome in a collective, so
the tasks must finish within `train.collective_timeout_s`; if they fail there, every rank fails.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.config.model import ModelConfig
from tessera.models.transformer import Transformer
from tessera.train.run.layout import RunLayout


class TaskEvaluator(Protocol):
    def __call__(self, model: Transformer, step: int) -> dict[str, float]:
        """The tasks' metrics (`"<task>/<metric>": value`) of `model`, the whole model at `step`."""


def whole_state(parts: list[nn.Module], layout: RunLayout) -> dict[str, torch.Tensor] | None:
    """Every weight and buffer of the model, whole, on the CPU, on rank 0 (None on the other ranks)."""
    local = {}
    for part in parts:
        for name, tensor in part.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            local[name] = tensor.detach().to("cpu", copy=True)
    if not layout.distributed:
        return local
    stage_size = layout.world_size // (layout.dims.pp if layout.dims is not None else 1)
    sent = local if layout.rank % stage_size == 0 else {}  # one rank per pipeline stage sends its stage
    gathered = [None] * layout.world_size if layout.is_coordinator else None
    dist.gather_object(sent, gathered, dst=0)
    if not layout.is_coordinator:
        return None
    return {name: t for stage in gathered for name, t in stage.items()}


def evaluate_tasks(evaluator: TaskEvaluator, parts: list[nn.Module], layout: RunLayout, model_cfg: ModelConfig,
                   step: int) -> dict[str, float]:
    """The evaluator's metrics of the model of `parts` (on rank 0; {} on the other ranks). If it
    raises on rank 0, every rank raises (`RunLayout.on_coordinator`)."""
    with layout.phase("gathering the model for train.eval_tasks"):
        state = whole_state(parts, layout)

    def run() -> dict[str, float]:
        model = Transformer(model_cfg, init_seed=None)
        model.load_state_dict(state, strict=True)
        state.clear()
        return evaluator(model.cast(torch.float32, layout.device).eval(), step)

    with layout.phase("train.eval_tasks"):
        return layout.on_coordinator(run) or {}
