"""Forward/backward of one global batch through pipeline stages (pp > 1, with any of dp / tp / sp / ep /
cp; under cp the stages pass on hidden states of this rank's sequence chunk).

The full model, built identically on every rank (on the meta device, materialised by name after
the split: tessera.parallel.meta_init), is cut into this rank's stages and each stage is
parallelized (`tessera.parallel.build_pipeline`); the schedule (gpipe, 1f1b, interleaved_1f1b,
zero_bubble) cuts this rank's rows into `microbatches` micro-batches
(`parallel.microbatches`, default: rows / train.micro_batch_size).

Numerics are those of one process: the last stage's loss of a micro-batch is its token-loss sum /
N (loss tokens of the whole global batch), and every stage's MoE auxiliary loss enters backward
with weight 1/M (M = micro-batches over all data-parallel ranks) through the stage output. MoE
auxiliary losses, routing statistics and expert capacity belong to the pipeline's micro-batch
(Megatron-Core's convention): with `parallel.microbatches` set, one of rows / microbatches
samples, which is what one process computes with `train.micro_batch_size` of that size.
Statistics the schedule does not return (auxiliary losses, routing counts) are read by a forward
hook on each stage that runs before the stage hands its output on. Tied embeddings: the first and
last stage each hold the embedding; their gradients are summed after the schedule's backward and
the norm counts it once (tessera.parallel.tied_embeddings). A `StepEngine`: mixed
precision, clipping, the expert-bias step and the statistics are those of step_engine.py and
step_stats.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.config.schema import RunConfig
from tessera.data.batching import Batch
from tessera.models.transformer import ModelOutput
from tessera.parallel import build_pipeline, global_count, global_sum, parallelize, token_dim
from tessera.parallel.dims import ParallelDims
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.parallel.distributed_optimizer import clip_grad_norm as distributed_clip_grad_norm
from tessera.parallel.tied_embeddings import TiedEmbeddings
from tessera.train.loss import IGNORE_INDEX, token_loss_sum
from tessera.train.parallel_step import padded_batch, rank_rows
from tessera.train.step_engine import clip_parts_grad_norm, mixed_precision, update_parts_expert_bias
from tessera.train.step_stats import StepStats, reduce_over_ranks, step_result


class PipelineStep:
    """The `StepEngine` of layouts with pp > 1."""

    def __init__(self, model: nn.Module, dims: ParallelDims, cfg: RunConfig, device: torch.device,
                 autocast_dtype: torch.dtype | None, param_dtype: torch.dtype, compile_blocks: bool):
        t, pcfg = cfg.train, cfg.parallel
        self.dims, self.device, self.autocast_dtype = dims, device, autocast_dtype
        self.global_batch_size = t.global_batch_size
        rows = t.global_batch_size // dims.dp_size
        self.microbatches = pcfg.microbatches or rows // t.micro_batch_size
        self.micro_batches_global = self.microbatches * dims.dp_size
        self._divisor = 1.0  # the loss tokens N of the current batch (1 while evaluating: plain sums)
        # What the loss function and the stages' forwards saw in the current step. The schedule's
        # first step (and the first after an evaluation) also runs them once to infer shapes, before
        # the real micro-batches: only the last `microbatches` entries belong to the step.
        self._sums: list[torch.Tensor] = []
        self._routing: dict[int, list[ModelOutput]] | None = None  # stage index -> outputs, while training

        def stage(m: nn.Module) -> nn.Module:
            return parallelize(m, dims, pcfg, param_dtype=param_dtype, reduce_dtype=torch.float32,
                               device_type=device.type, compile_blocks=compile_blocks)

        self.run = build_pipeline(model, dims, pcfg, self.microbatches, loss_fn=self._loss,
                                  aux_scale=1.0 / self.micro_batches_global, parallelize_stage=stage,
                                  device=device)
        self.parts = list(self.run.modules)
        # parallel.optimizer=distributed: one per part, attached by the trainer; they reduce the gradients
        # after the schedule (its micro-batches are its own, so no reduce-scatter starts inside it)
        self.distributed_optimizers: list[DistributedOptimizer] = []
        for i, m in enumerate(self.parts):
            m.register_forward_hook(partial(self._capture_routing, i), prepend=True)
        # The first and last stage each hold the tied embedding (tessera.parallel.tied_embeddings).
        self.tied = TiedEmbeddings(self.parts, dims) if cfg.model.tie_embeddings else None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        micro_sum = token_loss_sum(logits, targets)
        self._sums.append(micro_sum.detach())
        return micro_sum / self._divisor

    def _capture_routing(self, index: int, module: nn.Module, args: Any, out: ModelOutput) -> None:
        if self._routing is not None:  # training: a stage's ModelOutput, before it becomes a tensor
            self._routing.setdefault(index, []).append(ModelOutput(
                logits=None, aux_loss=out.aux_loss.detach(),
                aux_losses={k: v.detach() for k, v in out.aux_losses.items()},
                expert_counts={k: v.detach() for k, v in out.expert_counts.items()}))

    def forward_backward(self, batch: Batch) -> dict[str, Any]:
        inputs, targets = rank_rows(batch, self.dims)
        n_loss_tokens = global_count(int((targets != IGNORE_INDEX).sum()), self.dims)
        self._divisor, self._sums, self._routing = float(max(n_loss_tokens, 1)), [], {}
        try:
            with mixed_precision(self.device, self.autocast_dtype):
                self.run.step(inputs.to(self.device), targets.to(self.device))
            if self.tied is not None:
                self.tied.reduce_gradients()
            routing = self._routing
        finally:
            self._routing = None
        local = StepStats()
        for s in self._sums[-self.microbatches:]:
            local.add_loss(s)
        for outputs in routing.values():
            for out in outputs[-self.microbatches:]:
                local.add_routing(out)
        stats = reduce_over_ranks(local, self.dims)
        return step_result(stats, n_loss_tokens, self.micro_batches_global, int(batch.inputs.numel()))

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.distributed_optimizers:
            return distributed_clip_grad_norm(self.distributed_optimizers, max_norm)
        uncounted = self.tied.uncounted if self.tied is not None else ()
        return clip_parts_grad_norm(self.parts, max_norm, self.dims, uncounted)

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        update_parts_expert_bias(self.parts, counts, self.device)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches (forward-only schedule)."""
        total = torch.zeros((), dtype=torch.float64)
        n = 0
        self._divisor = 1.0
        for batch in batches:
            inputs, targets = rank_rows(padded_batch(batch, self.global_batch_size), self.dims)
            self._sums = []
            with mixed_precision(self.device, self.autocast_dtype):
                self.run.eval_step(inputs.to(self.device), targets.to(self.device))
            for s in self._sums[-self.microbatches:]:
                total += s.double().cpu()
            n += int((targets != IGNORE_INDEX).sum())
        # The loss lives on the last stage: sum it over data-parallel (and cp) ranks, then over stages.
        tokens = token_dim(self.dims)
        total = global_sum(global_sum(total, self.dims, tokens), self.dims, "pp")
        return float(total), int(global_sum(n, self.dims, tokens))
