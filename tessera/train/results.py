"""What a training step and a training run hand back: `StepResult` (a step engine's figures of one
global batch, completed by the trainer's update) and `TrainResult` (what a `Trainer.train()` call did).

A step engine (step_engine.py) fills the figures of its forward and backward: the loss, token
counts, routing statistics and the objective terms' losses (distillation, multi-token prediction),
and a mode's own named figures in `scalars` (EAGLE's per-step losses and accuracies:
train/modes/eagle.py). The trainer adds the update's: learning rate, gradient norm, whether the update was
skipped, the fp16 loss scale, a loss spike, the step's communication. A mode's record function
(metric_record.py for a model's run) turns it into the metrics line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.train.run.loss_spike import Spike


@dataclass
class StepResult:
    loss: float  # the step's loss: cross-entropy per loss token of the global batch (aux losses excluded)
    tokens: int  # input tokens of the global batch (what throughput and tokens_seen count)
    loss_tokens: int = 0  # tokens scored by the loss (fewer than `tokens` under an SFT mask)
    aux_loss: float = 0.0  # MoE auxiliary loss per micro-batch of the global batch
    aux_parts: dict[str, float] = field(default_factory=dict)  # "layer{i}/{name}" -> per micro-batch
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routing slots per expert, summed
    distill_loss: float | None = None  # the KD term per loss token (train.distill.teacher), else None
    distill_hidden_loss: float | None = None  # hidden-state matching per loss token (hidden_layers)
    mtp_losses: dict[int, float] = field(default_factory=dict)  # MTP depth -> its loss per main loss token
    scalars: dict[str, float] = field(default_factory=dict)  # the mode's own named figures, in logging order
    # the update's, set by the trainer
    lr: float = 0.0
    grad_norm: float = math.nan  # the whole model's, before clipping (NaN: no update, a refused spike)
    skipped: bool = False  # the update was skipped (a gradient that is not finite, or a loss spike)
    loss_scale: float | None = None  # fp16: the scale this step's backward used
    spike: Spike | None = None  # the loss-spike rule refused this step (loss_spike.py)
    comm: dict[str, Any] = field(default_factory=dict)  # log.comm_stats: comm/<kind>_calls, _bytes

    @property
    def mtp_loss(self) -> float | None:
        """The mean of the depths' losses (model.mtp_depth > 0), else None."""
        if not self.mtp_losses:
            return None
        return sum(self.mtp_losses.values()) / len(self.mtp_losses)


@dataclass
class TrainResult:
    """What a `train()` call did."""

    start_step: int  # the step the run started from (0, or the resumed checkpoint's)
    last_step: int  # the last completed optimizer step
    stopped_by_signal: int | None = None  # SIGTERM/SIGINT number when stopped early, else None
    checkpoint: Path | None = None  # the last checkpoint written
    records: list[dict[str, Any]] = field(default_factory=list)  # the metric records written (rank 0)
    # what the mode's end-of-run hook wrote on rank 0: a model run's HuggingFace directory
    # (checkpoint.export_hf), an EAGLE run's draft directory; None: nothing (or another rank)
    written: Path | None = None
