"""Forward/backward of one global batch in one process: micro-batches accumulated in order.

This is the reference every parallel layout is measured against (docs/architecture.md, "Numerics
contract"): a change to its arithmetic changes every run's losses and every layout's reference. The pieces
it shares with the parallel engines (micro-batch loop, mixed precision, clipping, expert bias)
are in step_engine.py.

Under bf16/fp16 the matrix weights' compute copies are made once per step, not once per
micro-batch (`CachedComputeWeights`, unless `cast_weights_per_step` is false): the same
arithmetic as autocast casting them in every forward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tessera.data.batching import Batch
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.objectives.loss import count_loss_tokens, masked_targets
from tessera.train.results import StepResult
from tessera.train.steps.compute_weights import CachedComputeWeights
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.step_engine import (
    accumulate_micro_batches,
    clip_parts_grad_norm,
    loss_sum_over_rows,
    update_parts_expert_bias,
)
from tessera.train.steps.step_stats import step_result


class SingleProcessStep:
    """The `StepEngine` of a one-process run."""

    def __init__(self, model: nn.Module, micro_batch_size: int, accumulation: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, cast_weights_per_step: bool = True,
                 loss_scaler: DynamicLossScaler | None = None, distiller: Distiller | None = None):
        self.parts = [model]
        self.distiller = distiller  # train.distill: the frozen teacher and the KD objective
        self.model, self.mb, self.accumulation = model, micro_batch_size, accumulation
        self.device, self.autocast_dtype, self.loss_scaler = device, autocast_dtype, loss_scaler
        self.compute_weights = (CachedComputeWeights(model, autocast_dtype)
                                if autocast_dtype is not None and cast_weights_per_step else None)

    def forward_backward(self, batch: Batch) -> StepResult:
        """Accumulate the gradient of one global batch; return its loss statistics."""
        n_loss_tokens = count_loss_tokens(batch.targets, batch.target_mask)
        rows = self.accumulation * self.mb
        targets = masked_targets(batch.targets, batch.target_mask)
        forward = None
        if self.compute_weights is not None:
            self.compute_weights.refresh()  # the weights changed in the last optimizer step
            forward = self.compute_weights.forward
        stats = accumulate_micro_batches(
            self.model, batch.inputs[:rows], targets[:rows], self.mb, n_loss_tokens, self.accumulation,
            self.device, self.autocast_dtype, forward=forward, loss_scaler=self.loss_scaler,
            distiller=self.distiller, pixels=batch.pixel_values[:rows] if batch.pixel_values is not None else None,
            grids=batch.image_grid_thw[:rows] if batch.image_grid_thw is not None else None)
        return step_result(stats, n_loss_tokens, self.accumulation, int(batch.inputs.numel()))

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_parts_grad_norm(self.parts, max_norm, None)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches."""
        rows = ((b.inputs, masked_targets(b.targets, b.target_mask), b.pixel_values, b.image_grid_thw)
                for b in batches)
        total, n = loss_sum_over_rows(self.model, rows, self.mb, self.device, self.autocast_dtype)
        return float(total), n
