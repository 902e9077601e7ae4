"""Forward/backward of one global batch through pipeline stages (pp > 1, with any of dp / tp / sp / ep /
cp; under cp the stages pass on hidden states of this rank's sequence chunk).

The engine receives its `Pipeline` finished (tessera.train.builder): the full model, built
identically on every rank on the meta device, cut into this rank's stages, each stage parallelized
(`tessera.parallel.build_pipeline`) and then materialised (tessera.parallel.meta_init), and the
schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble) that cuts this rank's rows into
`microbatches` micro-batches (`parallel.microbatches`, default: rows / train.micro_batch_size).

Distillation (train.distill): the teacher's stages run beside the student's, their activations
travelling with the student's through the same schedule (`attach_teacher`), and the loss function
mixes the KD term in on the last stage.

Numerics are those of one process: the last stage's loss of a micro-batch is its token-loss sum /
N (loss tokens of the whole global batch), and every stage's MoE auxiliary loss enters backward
with weight 1/M (M = micro-batches over all data-parallel ranks) through the stage output. MoE
auxiliary losses, routing statistics and expert capacity belong to the pipeline's micro-batch
(Megatron-Core's convention): with `parallel.microbatches` set, one of rows / microbatches
samples, which is what one process computes with `train.micro_batch_size` of that size.
Statistics the schedule does not return (auxiliary losses, routing counts) are read by a forward
hook on each stage that runs before the stage hands its output on. Tied embeddings: the first and
last stage each hold the embedding; their gradients are summed after the schedule's backward and
the norm counts it once (tessera.parallel.tied_embeddings); with multi-token prediction
(model.mtp_depth) the last stage holds the embedding too, the same way, and gets the token ids,
targets and N as the schedule's keyword arguments: its MTP loss / N rides on its auxiliary loss.
A vision-language model's first stage (which holds the tower and projector) gets the images of its
rows as keyword arguments too, padded per row (`padded_images`), so that the schedule cuts them into
the micro-batches of the rows; no other rank is given them. Qwen2-VL / Qwen2.5-VL's M-RoPE positions
come from the whole rows and their grids, which only the first stage is given: every rank computes
its rows' positions from the batch it holds (`rank_row_positions`) and hands them to all its stages
as a keyword tensor, rows first, cut into the same micro-batches.
fp16: the loss function returns its
loss scaled, and each stage scales its auxiliary loss's gradient (loss_scaler.py). A `StepEngine`: mixed
precision, clipping, the expert-bias step and the statistics are those of step_engine.py and
step_stats.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.data.batching import Batch
from tessera.models.transformer import ModelOutput
from tessera.parallel import PipelineRun, global_count, global_sum, token_dim
from tessera.parallel.dims import ParallelDims
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.parallel.pipeline_companion import attach_companion
from tessera.parallel.tied_embeddings import TiedEmbeddings
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.objectives.loss import IGNORE_INDEX, token_loss_sum
from tessera.train.results import StepResult
from tessera.train.steps.loss_scaler import DynamicLossScaler
from tessera.train.steps.parallel_step import padded_batch, rank_rows
from tessera.train.steps.step_engine import clip_parts_grad_norm, mixed_precision, update_parts_expert_bias
from tessera.train.steps.step_stats import StepStats, reduce_over_ranks, step_result
from tessera.train.vision_language import rank_image_grids, rank_images, rank_row_positions


class PipelineLoss:
    """The schedule's loss function (it runs on the last stage): a micro-batch's token-loss sum /
    N, N the loss tokens of the whole global batch (1 while evaluating: plain sums). It keeps the
    sums it saw for the step's statistics: the schedule's first step (and the first after an
    evaluation) also runs it once to infer shapes, before the real micro-batches, so only the last
    `microbatches` entries belong to the step. fp16: the loss it returns is scaled (loss_scaler.py).
    With a `distiller` (train.distill, attached by `attach_teacher`) the last stage returns
    (student logits, teacher logits) and, while training, the loss is the distillation objective's
    (1 - w) CE + w KD sums / N (distill_loss.py), the KD sums kept beside the CE sums."""

    def __init__(self, loss_scaler: DynamicLossScaler | None = None):
        self.loss_scaler = loss_scaler
        self.distiller: Distiller | None = None
        self.divisor, self.evaluating = 1.0, False
        self.sums: list[torch.Tensor] = []
        self.kd_sums: list[torch.Tensor] = []

    def start(self, divisor: float, evaluating: bool = False) -> None:
        """A new step (divisor N) or evaluation batch (divisor 1): forget the sums seen so far."""
        self.divisor, self.evaluating, self.sums, self.kd_sums = divisor, evaluating, [], []

    def __call__(self, logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor
                 ) -> torch.Tensor:
        teacher_logits = None
        if self.distiller is not None:
            logits, teacher_logits = logits
        micro_sum = token_loss_sum(logits, targets)
        self.sums.append(micro_sum.detach())
        if teacher_logits is None or self.evaluating:
            loss = micro_sum / self.divisor
        else:
            kd_sum = self.distiller.kd_sum(logits, teacher_logits, targets)
            self.kd_sums.append(kd_sum.detach())
            loss = self.distiller.mix(micro_sum, kd_sum) / self.divisor
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)


def _padded_rows(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K, ...] of the rows' [N_i, ...] tensors, each padded with zeros to K = max N_i, and the
    mask [B, K], true at the real entries."""
    K = max(len(t) for t in tensors)
    padded = tensors[0].new_zeros((len(tensors), K) + tuple(tensors[0].shape[1:]))
    mask = torch.zeros(len(tensors), K, dtype=torch.bool)
    for i, t in enumerate(tensors):
        padded[i, :len(t)] = t
        mask[i, :len(t)] = True
    return padded, mask


def padded_images(pixels: list[torch.Tensor] | None, grids: list[torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for the images of a rank's rows. A schedule cuts every keyword
    tensor into micro-batches along dim 0, which one stack of all the rows' images could not follow,
    so each row's are padded. LLaVA (`pixels` one [N_i, C, H, W] per row): `pixel_values`
    [B, K, C, H, W], padded to K = max N_i (0 when no row has one), and `image_mask` [B, K], true at
    the real ones. Qwen2-VL / Qwen2.5-VL (`pixels` each row's patch rows [P_i, F], `grids` its
    [N_i, 3] grids): `pixel_values` [B, P, F] padded to P = max P_i, `image_grid_thw` [B, K, 3]
    padded with zero grids and `image_mask` [B, K] (`qwen_vl.unpadded_images`). Empty for a text
    batch."""
    if pixels is None:
        return {}
    if grids is None:
        pixel_values, mask = _padded_rows(pixels)
        return {"pixel_values": pixel_values, "image_mask": mask}
    pixel_values, _ = _padded_rows(pixels)  # a row's real patch rows follow from its grids
    image_grid_thw, mask = _padded_rows(grids)
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw, "image_mask": mask}


@dataclass
class Pipeline:
    """This rank's part of the pipeline, built finished (tessera.train.builder): the schedule over
    its parallelized, materialised stages, the loss function the schedule calls, the micro-batches
    of one data-parallel rank per step, and the tied embedding's copies (None: untied)."""

    run: PipelineRun
    loss: PipelineLoss
    microbatches: int
    tied: TiedEmbeddings | None


def attach_teacher(pipeline: Pipeline, distiller: Distiller, dim: int) -> None:
    """Run the distillation teacher's stages (distiller.teacher: this rank's, in the order of the
    student's) beside the student's stages of hidden size `dim`, their activations travelling
    together (tessera.parallel.pipeline_companion); the loss function mixes in the KD term."""
    run = pipeline.run
    for stage, teacher_stage, s in zip(run.modules, distiller.teacher, run.stage_ids, strict=True):
        attach_companion(stage, teacher_stage, dim, last=s == run.num_stages - 1)
    pipeline.loss.distiller = distiller


class PipelineStep:
    """The `StepEngine` of layouts with pp > 1."""

    def __init__(self, pipeline: Pipeline, dims: ParallelDims, global_batch_size: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, distributed_optimizers: Sequence[DistributedOptimizer] = ()):
        self.run, self.loss, self.tied = pipeline.run, pipeline.loss, pipeline.tied
        self.dims, self.device, self.autocast_dtype = dims, device, autocast_dtype
        self.global_batch_size = global_batch_size
        self.microbatches = pipeline.microbatches
        self.micro_batches_global = self.microbatches * dims.dp_size
        self.parts = list(self.run.modules)
        self.mtp = any(getattr(m, "mtp", None) is not None for m in self.parts)  # this rank holds MTP modules
        # parallel.optimizer=distributed: one per part; they reduce the gradients after the
        # schedule (its micro-batches are its own, so no reduce-scatter starts inside it)
        self.distributed_optimizers = list(distributed_optimizers)
        # What the stages' forwards saw in the current step (only the last `microbatches` count)
        self._routing: dict[int, list[ModelOutput]] | None = None  # stage index -> outputs, while training
        for i, m in enumerate(self.parts):
            m.register_forward_hook(partial(self._capture_routing, i), prepend=True)

    def _capture_routing(self, index: int, module: nn.Module, args: Any, out: ModelOutput) -> None:
        if self._routing is not None:  # training: a stage's ModelOutput, before it becomes a tensor
            self._routing.setdefault(index, []).append(ModelOutput(
                logits=None, aux_loss=out.aux_loss.detach(),
                aux_losses={k: v.detach() for k, v in out.aux_losses.items()},
                expert_counts={k: v.detach() for k, v in out.expert_counts.items()},
                mtp_loss_sums={k: v.detach() for k, v in out.mtp_loss_sums.items()}))

    def forward_backward(self, batch: Batch) -> StepResult:
        inputs, targets = rank_rows(batch, self.dims)
        n_loss_tokens = global_count(int((targets != IGNORE_INDEX).sum()), self.dims)
        self.loss.start(float(max(n_loss_tokens, 1)))
        self._routing = {}
        try:
            # multi-token prediction: the last stage, which receives hidden states, gets the ids too
            mtp = {} if not self.mtp else {"mtp_inputs": inputs.contiguous().to(self.device),
                                           "mtp_targets": targets.contiguous().to(self.device),
                                           "mtp_divisor": self.loss.divisor}
            with mixed_precision(self.device, self.autocast_dtype):
                self.run.step(inputs.to(self.device), targets.to(self.device), **mtp, **self._images(batch))
            if self.tied is not None:
                self.tied.reduce_gradients()
            routing = self._routing
        finally:
            self._routing = None
        local = StepStats()
        for s in self.loss.sums[-self.microbatches:]:
            local.add_loss(s)
        for s in self.loss.kd_sums[-self.microbatches:]:
            local.add_distill(s)
        for outputs in routing.values():
            for out in outputs[-self.microbatches:]:
                local.add_routing(out)
        stats = reduce_over_ranks(local, self.dims)
        return step_result(stats, n_loss_tokens, self.micro_batches_global, int(batch.inputs.numel()))

    def _images(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The first stage's images of this rank's rows (`padded_images`), none elsewhere; and for a
        model whose positions come from the whole rows (Qwen2-VL's M-RoPE), every stage's positions
        of this rank's tokens (`rank_row_positions`): only the first stage sees the ids they come
        from, but every stage's RoPE rotates by them. On the device."""
        kw = {}
        if self.run.has_first_stage:
            kw.update(padded_images(rank_images(batch, self.dims), rank_image_grids(batch, self.dims)))
        positions = rank_row_positions(self.parts[0], batch, self.dims)
        if positions is not None:
            kw["row_positions"] = positions
        return {k: v.to(self.device) for k, v in kw.items()}

    def clip_grad_norm(self, max_norm: float) -> float:
        uncounted = self.tied.uncounted if self.tied is not None else ()
        return clip_parts_grad_norm(self.parts, max_norm, self.dims, uncounted, self.distributed_optimizers)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches (forward-only schedule)."""
        total = torch.zeros((), dtype=torch.float64)
        n = 0
        for batch in batches:
            batch = padded_batch(batch, self.global_batch_size)
            inputs, targets = rank_rows(batch, self.dims)
            self.loss.start(1.0, evaluating=True)
            with mixed_precision(self.device, self.autocast_dtype):
                self.run.eval_step(inputs.to(self.device), targets.to(self.device), **self._images(batch))
            for s in self.loss.sums[-self.microbatches:]:
                total += s.double().cpu()
            n += int((targets != IGNORE_INDEX).sum())
        # The loss lives on the last stage: sum it over data-parallel (and cp) ranks, then over stages.
        tokens = token_dim(self.dims)
        total = global_sum(global_sum(total, self.dims, tokens), self.dims, "pp")
        return float(total), int(global_sum(n, self.dims, tokens))
