"""Forward/backward of one global batch on several ranks without pipeline stages (data, tensor +
sequence, expert and context parallelism in any combination).

A `StepEngine` (step_engine.py holds the micro-batch loop, mixed precision, clipping and the
expert-bias step that all engines share). Every rank receives the same global batch and reads its
own rows (`dp_rows`: data-parallel coordinate d reads block d); tensor-parallel peers read the
same rows, context-parallel peers each their chunk of every sequence of them
(`shard_global_batch`).

The objective follows the numerics contract (docs/architecture.md, "Numerics contract";
tessera.train.objectives.loss):

    loss_r = sum over rank r's micro-batches of [ CE token sum / N  +  aux / M ]

with N the loss tokens of the whole global batch (`global_count`) and M its micro-batches over
all data-parallel ranks (under cp, a rank's CE sum and aux are its chunk's share of the
micro-batch's). FSDP sums the ranks' gradients, so the step's gradient is that of the
global-batch loss, as in one process. Positions outside an SFT loss mask get the ignore index in
the targets, so the vocabulary-parallel loss (which cannot take a mask) skips them too.

Gradient accumulation synchronises once per step: for every micro-batch but the last, FSDP's
gradient reduction is turned off (`set_requires_gradient_sync(False)` on the root and, through
it, every unit), so each rank accumulates its unsharded gradients locally and each unit's
gradient is reduce-scattered (HSDP: and all-reduced across replicas) once, after the last
micro-batch's backward, instead of once per micro-batch.

With `parallel.optimizer=distributed` there is no FSDP: the distributed optimizers it is given
(tessera.parallel.distributed_optimizer) are told which micro-batch is the last, reduce-scatter
each gradient bucket during that micro-batch's backward, and measure the gradient norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from tessera.data.batching import Batch
from tessera.parallel import global_count, global_sum, shard_global_batch, token_dim
from tessera.parallel.dims import ParallelDims
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.objectives.loss import IGNORE_INDEX, masked_targets
from tessera.train.results import StepResult
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.step_engine import (
    accumulate_micro_batches,
    clip_parts_grad_norm,
    loss_sum_over_rows,
    sync_gradients,
    update_parts_expert_bias,
)
from tessera.train.steps.step_stats import reduce_over_ranks, step_result
from tessera.train.vision_language import rank_image_grids, rank_images


def rank_rows(batch: Batch, dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of a global batch (its rows; under cp its chunk of each
    sequence); masked-out targets hold IGNORE_INDEX."""
    targets = masked_targets(batch.targets, batch.target_mask)
    return shard_global_batch(batch.inputs, dims), shard_global_batch(targets, dims)


def padded_batch(batch: Batch, rows: int) -> Batch:
    """`batch` grown to `rows` samples with rows that count no loss token (the last validation batch
    may be short, but every rank and pipeline micro-batch needs its full share)."""
    missing = rows - batch.tokens.shape[0]
    if missing <= 0:
        return batch
    tokens = torch.cat([batch.tokens, batch.tokens[:1].expand(missing, -1)])
    mask = torch.cat([batch.loss_mask, torch.zeros(missing, batch.loss_mask.shape[1], dtype=torch.bool)])
    pixels = None if batch.pixel_values is None else batch.pixel_values + batch.pixel_values[:1] * missing
    grids = None if batch.image_grid_thw is None else batch.image_grid_thw + batch.image_grid_thw[:1] * missing
    return Batch(tokens=tokens, loss_mask=mask, pixel_values=pixels, image_grid_thw=grids)


class ParallelStep:
    """The `StepEngine` of dp_replicate / dp_shard / tp / sp / ep / cp layouts (pp = 1)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, micro_batch_size: int, global_batch_size: int,
                 device: torch.device, autocast_dtype: torch.dtype | None,
                 distributed_optimizers: Sequence[DistributedOptimizer] = (),
                 loss_scaler: DynamicLossScaler | None = None, distiller: Distiller | None = None):
        self.parts = [model]
        self.distiller = distiller  # train.distill: the frozen teacher, cut by the same layout
        self.model, self.dims, self.mb, self.global_batch_size = model, dims, micro_batch_size, global_batch_size
        self.device, self.autocast_dtype, self.loss_scaler = device, autocast_dtype, loss_scaler
        # parallel.optimizer=distributed: they reduce the gradients and measure their norm
        self.distributed_optimizers = list(distributed_optimizers)

    def forward_backward(self, batch: Batch) -> StepResult:
        inputs, targets = rank_rows(batch, self.dims)
        n_loss_tokens = global_count(int((targets != IGNORE_INDEX).sum()), self.dims)
        micro_batches = inputs.shape[0] // self.mb * self.dims.dp_size
        local = accumulate_micro_batches(
            self.model, inputs, targets, self.mb, n_loss_tokens, micro_batches, self.device, self.autocast_dtype,
            before_backward=self._sync_gradients, loss_scaler=self.loss_scaler, distiller=self.distiller,
            pixels=rank_images(batch, self.dims), grids=rank_image_grids(batch, self.dims))
        if self.distiller is not None and self.distiller.hidden is not None:
            self.distiller.hidden.reduce_gradients(self.dims)  # the projections, replicated on every rank
        stats = reduce_over_ranks(local, self.dims)
        return step_result(stats, n_loss_tokens, micro_batches, int(batch.inputs.numel()))

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        """Reduce gradients over data-parallel ranks in this backward only on the step's last micro-batch."""
        sync_gradients(self.model, self.distributed_optimizers, last_micro_batch)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_parts_grad_norm(self.parts, max_norm, self.dims,
                                    distributed_optimizers=self.distributed_optimizers)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches, summed over ranks."""
        padded = (padded_batch(b, self.global_batch_size) for b in batches)
        rows = ((*rank_rows(b, self.dims), rank_images(b, self.dims), rank_image_grids(b, self.dims)) for b in padded)
        total, n = loss_sum_over_rows(self.model, rows, self.mb, self.device, self.autocast_dtype)
        both = global_sum(torch.stack([total, torch.tensor(float(n), dtype=torch.float64)]), self.dims,
                          token_dim(self.dims))
        return float(both[0]), int(both[1])
