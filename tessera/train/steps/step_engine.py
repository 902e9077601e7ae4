"""The step engine: what the trainer calls to turn one global batch into gradients and statistics,
whatever the layout, and the pieces the engines share.

Three engines implement `StepEngine`: `SingleProcessStep` (one process, the reference every
layout is measured against), `ParallelStep` (data, tensor + sequence, expert and context
parallelism, pp = 1) and `PipelineStep` (pp > 1 with any of those). tessera.train.builder
constructs the one of the layout over finished parts: parallelized and materialised modules, the
distributed optimizers where they reduce the gradients, the fp16 loss scaler, and under pp the
schedule. The engines change no module they are given except for the statistics hooks of
`PipelineStep`. The trainer unscales, clips and steps the optimizers after `forward_backward`.
They share here:

- `mixed_precision`: the autocast region of forward passes (bf16 compute over fp32 weights);
- `accumulate_micro_batches`: forward (with the targets, so a model whose `loss_chunk_tokens` is
  set returns its chunked LM-head loss instead of logits: `model_loss_sum`), the micro-batch's
  share of the global-batch objective (`loss.micro_batch_objective`; with multi-token prediction
  its weighted token-loss sum joins the main one), multiplied by the fp16 loss
  scale, and backward for each micro-batch of a rank's rows, statistics
  gathered in a `StepStats` (the pipeline schedule runs its own micro-batches);
- `loss_sum_over_rows`: the evaluation sums (token-loss sum, loss tokens) of a rank's rows;
- `clip_parts_grad_norm`: the whole model's gradient norm, clipped (torch's `clip_grad_norm_` in one
  process, the reference arithmetic; `tessera.parallel.clip_grad_norm_` over a layout; the
  distributed optimizers' own under parallel.optimizer=distributed);
- `sync_gradients`: the gradient reduction over data-parallel ranks turned on for a rank's last
  micro-batch only (FSDP, or the distributed optimizers);
- `update_parts_expert_bias`: the aux-loss-free balancing step of every part's MoE layers.

Targets arrive with the positions outside an SFT loss mask set to IGNORE_INDEX (`masked_targets`),
so the loss and the token counts need no mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tessera.data.batching import Batch
from tessera.models.model_input import ModelInput
from tessera.parallel import clip_grad_norm_
from tessera.parallel.dims import ParallelDims
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.parallel.distributed_optimizer import clip_grad_norm as distributed_clip_grad_norm
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.objectives.loss import IGNORE_INDEX, micro_batch_objective, token_loss_sum
from tessera.train.results import StepResult
from tessera.train.run.profile_record import mark
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.step_stats import StepStats


@runtime_checkable
class StepEngine(Protocol):
    parts: list[nn.Module]  # the model modules this rank optimises and checkpoints

    def forward_backward(self, batch: Batch) -> StepResult:
        """Accumulate the gradient of one global batch; return its figures (results.py)."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the whole model's gradient to `max_norm` (<= 0: no clipping); return the norm before."""
        ...

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """One aux-loss-free balancing step from the step's summed routing counts (layer -> [E])."""
        ...

    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches, over all ranks."""
        ...


def mixed_precision(device: torch.device, autocast_dtype: torch.dtype | None) -> AbstractContextManager:
    """Autocast to `autocast_dtype` on `device`; a disabled region when it is None (fp32)."""
    return torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None)


def accumulate_micro_batches(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int,
                             global_loss_tokens: int, global_micro_batches: int, device: torch.device,
                             autocast_dtype: torch.dtype | None,
                             before_backward: Callable[[bool], None] | None = None,
                             forward: Callable[..., Any] | None = None,
                             loss_scaler: DynamicLossScaler | None = None,
                             distiller: Distiller | None = None,
                             pixels: list[torch.Tensor] | None = None,
                             grids: list[torch.Tensor] | None = None) -> StepStats:
    """Forward and backward of every micro-batch of this rank's rows, in order; their statistics.

    `before_backward(last)` runs before each micro-batch's forward (`last`: the rank's final one),
    e.g. to let data parallelism reduce gradients only once per step. `forward` (default: `model`
    itself) runs the model, e.g. with its weights' compute copies (compute_weights.py). With
    `loss_scaler` (fp16) each micro-batch's objective is scaled (loss_scaler.py). With `distiller`
    (train.distill) the teacher runs forward on the same micro-batch and the objective mixes its
    KD term in (distill_loss.py), and the hidden-state matching term with `distiller.hidden`
    (hidden_match.py); the student then returns logits, never the chunked loss. `pixels` (a
    vision-language batch: one tensor per row of `inputs`) go to the model's forward as the
    micro-batch's `pixel_values`, its rows' images in order, and `grids` (Qwen2-VL's, one [N_i, 3]
    per row) as its `image_grid_thw` (`micro_batch_images`)."""
    forward = forward if forward is not None else model
    stats = StepStats()
    accumulation = inputs.shape[0] // micro_batch_size
    for i in range(accumulation):
        rows = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
        x = inputs[rows].to(device, non_blocking=True)
        y = targets[rows].to(device, non_blocking=True)
        if before_backward is not None:
            before_backward(i == accumulation - 1)
        images = micro_batch_images(pixels, grids, rows, device)
        with mixed_precision(device, autocast_dtype), mark("compute", "forward", microbatch=i):
            out = micro_batch_output(forward, x, y if distiller is None else None, images)
            teacher_logits = distiller.teacher_logits(x) if distiller is not None else None
        with mark("module", "loss", phase="forward"):
            micro_sum = model_loss_sum(out, y)
        # multi-token prediction (model.mtp_depth): its weighted token-loss sum joins the main one
        mtp_sum = getattr(out, "mtp_loss_sum", None)
        objective_sum = micro_sum if mtp_sum is None else micro_sum + mtp_sum
        if distiller is None:
            objective = micro_batch_objective(objective_sum, out.aux_loss, global_loss_tokens, global_micro_batches)
        else:
            kd_sum = distiller.kd_sum(out.logits, teacher_logits, y)
            hidden_sum = distiller.hidden.loss_sum(y) if distiller.hidden is not None else None
            objective = distiller.objective(micro_sum, kd_sum, out.aux_loss, global_loss_tokens, global_micro_batches,
                                            hidden_sum)
            stats.add_distill(kd_sum)
            if hidden_sum is not None:
                stats.add_hidden(hidden_sum)
        with mark("compute", "backward", microbatch=i):
            (objective if loss_scaler is None else loss_scaler.scale_loss(objective)).backward()
        stats.add_loss(micro_sum)
        stats.add_routing(out)
    return stats


def micro_batch_images(pixels: list[torch.Tensor] | None, grids: list[torch.Tensor] | None, rows: slice,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """The model's image arguments for the micro-batch `rows` of a batch's per-row images: none for
    text, `pixel_values` (the rows' images in order) and, with `grids`, `image_grid_thw`."""
    if pixels is None:
        return {}
    images = {"pixel_values": torch.cat(pixels[rows]).to(device)}
    if grids is not None:  # the grids stay where the model reads them to place and position the images
        images["image_grid_thw"] = torch.cat(grids[rows])
    return images


def micro_batch_output(forward: Callable[..., Any], x: torch.Tensor, y: torch.Tensor | None,
                       images: dict[str, torch.Tensor]) -> Any:
    """`forward` on a micro-batch's token ids `x` (with its targets `y` unless None): a decoder's
    one `ModelInput`, or, with `images` (`micro_batch_images`), a vision-language model's ids with its
    images and targets as its forward's keyword arguments."""
    if images:
        return forward(x, targets=y, **images)
    return forward(ModelInput(tokens=x, targets=y))


def model_loss_sum(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The micro-batch's token-loss sum: the model's own (chunked LM-head loss, when it computed
    one) or `token_loss_sum` of its logits."""
    return out.loss_sum if getattr(out, "loss_sum", None) is not None else token_loss_sum(out.logits, targets)


@torch.no_grad()
def loss_sum_over_rows(model: nn.Module, rows: Iterable[tuple[torch.Tensor, ...]], micro_batch_size: int,
                       device: torch.device, autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, int]:
    """(fp64 sum of token losses, loss tokens) of `model` over every (inputs, targets) of `rows`,
    micro-batch by micro-batch, summed in that order; a third element, when a row has one, is its
    vision-language batch's pixel values (one tensor per row, as `accumulate_micro_batches` takes)
    and a fourth its image grids (Qwen2-VL's; None otherwise)."""
    total = torch.zeros((), dtype=torch.float64)
    n = 0
    for inputs, targets, *images_of in rows:
        pixels, grids = (list(images_of) + [None, None])[:2]
        for i in range(0, inputs.shape[0], micro_batch_size):
            x = inputs[i:i + micro_batch_size].to(device)
            y = targets[i:i + micro_batch_size].to(device)
            images = micro_batch_images(pixels, grids, slice(i, i + micro_batch_size), device)
            with mixed_precision(device, autocast_dtype):
                out = micro_batch_output(model, x, y, images)
            total += model_loss_sum(out, y).double().cpu()
            n += int((y != IGNORE_INDEX).sum())
    return total, n


def clip_parts_grad_norm(parts: list[nn.Module], max_norm: float, dims: ParallelDims | None,
                         uncounted: Iterable[torch.Tensor] = (),
                         distributed_optimizers: Sequence[DistributedOptimizer] = ()) -> float:
    """Clip the gradients of `parts` so the whole model's norm is at most `max_norm` (<= 0: only
    measure it); return the norm before clipping. `dims` None: one process. `uncounted`: second
    copies of a parameter (tied embeddings on the last pipeline stage), clipped, not counted. With
    `distributed_optimizers` (parallel.optimizer=distributed) they hold the reduced gradients and
    measure and clip them."""
    if distributed_optimizers:
        return distributed_clip_grad_norm(distributed_optimizers, max_norm)
    params = [p for m in parts for p in m.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else math.inf
    if dims is None:
        return float(torch.nn.utils.clip_grad_norm_(params, limit))
    return float(clip_grad_norm_(params, limit, dims, uncounted=uncounted))


def sync_gradients(model: nn.Module, distributed_optimizers: Sequence[DistributedOptimizer],
                   last_micro_batch: bool) -> None:
    """Before a micro-batch's backward: reduce gradients over the data-parallel ranks in it only if it
    is the rank's last of the step (FSDP's gradient sync, or the distributed optimizers' buckets)."""
    for optimizer in distributed_optimizers:
        optimizer.start_micro_batch(last_micro_batch)
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch, recurse=True)


def update_parts_expert_bias(parts: list[nn.Module], counts: dict[int, torch.Tensor], device: torch.device) -> None:
    """Each part updates the expert bias of the MoE layers it holds (pipeline stages: their own)."""
    for m in parts:
        m.update_expert_bias({k: v.to(device) for k, v in counts.items()})
