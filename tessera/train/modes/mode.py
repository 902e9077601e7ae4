"""What a training mode hands the one training loop (trainer.py): the interface of the modes of
train/modes/registry.py.

A mode decides what a run trains and how: its model parts, their optimizers and the step engine
that turns a global batch into gradients and a `StepResult`; how a step is logged; what is said at
the start and the end; what is written when the run ends. The loop owns everything else, the same
for every mode: the run lock, seeding, the data, the schedule, the update (clipping, skipping a
step that is not finite, fp16 loss scaling, the loss-spike rule), the stop signal, the progress
bar, metrics.jsonl, checkpoints and resuming.

    mode = training_mode(cfg)                         # train/modes/registry.py: the registry entry the config selects
    cfg = mode.configure(cfg)                          # the config the run trains under
    parts = mode.build(ModeContext(cfg, layout, data, init_from, compile))   # ModeParts, finished
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.config.schema import RunConfig
from tessera.train.data_source import TrainingData
from tessera.train.results import StepResult, TrainResult
from tessera.train.run.layout import RunLayout
from tessera.train.run.metric_record import StepFigures
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.step_engine import StepEngine

# (step, its result, what the loop measured since the last line) -> the metrics line of the step
RecordFn = Callable[[int, StepResult, StepFigures], dict[str, Any]]


@dataclass
class ModeContext:
    """What a mode's builder is given: the run as the loop has set it up so far."""

    cfg: RunConfig  # as the mode's `configure` returned it
    layout: RunLayout  # this rank's place in the layout, its device
    data: TrainingData  # the run's batches (built, not yet drawn from)
    init_from: str | None  # train.init_from on a fresh run; None when resuming (the checkpoint has the weights)
    compile: bool  # train.compile as resolved for this layout (tessera.parallel.compile.resolve_compile)
    # what samples a GRPO run's completions (train/modes/grpo.py's RolloutSource: the serving engine, which this
    # layer does not import, so the caller passes it: Trainer(cfg, rollouts=...)); None for the other modes
    rollouts: Any = None


@dataclass
class ModeParts:
    """What a mode's builder hands the loop, finished."""

    engine: StepEngine  # its `parts` are what the loop checkpoints and the optimizers update
    optimizers: list[Any]  # one per part, checkpointed with it
    full_shapes: dict[str, tuple[int, ...]]  # every checkpointed tensor's whole shape (what loading checks)
    record: RecordFn  # the metrics line of a logged step
    summary: Callable[[int], list[str]]  # the start-up lines (rank 0, stderr), given the step the run starts at
    # the last lines of a run that trained: (stdout lines, stderr lines)
    closing: Callable[[TrainResult], tuple[list[str], list[str]]]
    # the end-of-run hook: (the step reached, the last checkpoint) -> what it wrote, or None; every rank
    # calls it once the last checkpoint is complete
    finish: Callable[[int, Path | None], Path | None]
    label: str = "train"  # the progress bar's
    evaluates: bool = True  # the loop measures the validation loss every train.eval_interval steps
    loss_scaler: DynamicLossScaler | None = None  # fp16: the scaler the engine applies
    beside: list[torch.optim.Optimizer] = field(default_factory=list)  # stepped and scheduled, not checkpointed
    init_from: str | None = None  # where the parts' weights were read from (None: initialised or resumed)
    init_bytes_read: int = 0  # bytes this rank read from `init_from`
    fp8_layers: list[nn.Module] = field(default_factory=list)  # linear layers converted to FP8 (train.fp8)


def as_configured(cfg: RunConfig) -> RunConfig:
    """The `configure` of a mode that trains the config as it is."""
    return cfg


@dataclass(frozen=True)
class TrainingMode:
    """One entry of the registry of modes (train/modes/registry.py)."""

    name: str
    selects: Callable[[RunConfig], bool]  # whether a run's config trains this mode
    build: Callable[[ModeContext], ModeParts]
    # the config the run trains under, before anything is built (EAGLE: the target's model section)
    configure: Callable[[RunConfig], RunConfig] = as_configured
