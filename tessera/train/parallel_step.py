"""Forward/backward of one global batch on several ranks without pipeline stages (data, tensor +
sequence, expert and context parallelism in any combination).

A step engine has `parts` (the model modules this rank optimises and checkpoints),
`forward_backward(batch) -> stats`, `clip_grad_norm(max_norm)`, `update_expert_bias(counts)` and
`evaluate(batches)`. Every rank receives the same global batch and reads its own rows
(`dp_rows`: data-parallel coordinate d reads block d); tensor-parallel peers read the same rows,
context-parallel peers each their chunk of every sequence of them (`shard_global_batch`).

The objective follows the numerics contract (DESIGN.md, tessera.train.loss):

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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tessera.data.batching import Batch
from tessera.parallel import clip_grad_norm_, global_count, global_sum, shard_global_batch, token_dim, token_loss_sum
from tessera.parallel.dims import ParallelDims
from tessera.train.loss import IGNORE_INDEX, masked_targets, micro_batch_objective
from tessera.train.step_stats import StepStats, reduce_over_ranks


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
    return Batch(tokens=tokens, loss_mask=mask)


def step_result(stats: StepStats, loss_tokens: int, micro_batches: int, tokens: int) -> dict[str, Any]:
    """The trainer's statistics of a step from its global StepStats."""
    return {"loss": stats.loss_sum / max(loss_tokens, 1), "aux_loss": stats.aux_total / micro_batches,
            "aux_parts": {k: v / micro_batches for k, v in stats.aux_parts.items()}, "counts": stats.counts,
            "loss_tokens": loss_tokens, "tokens": tokens}


class ParallelStep:
    """Step engine for dp_replicate / dp_shard / tp / sp / ep / cp layouts (pp = 1)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, micro_batch_size: int, global_batch_size: int,
                 device: torch.device, autocast_dtype: torch.dtype | None):
        self.parts = [model]
        self.model, self.dims, self.mb, self.global_batch_size = model, dims, micro_batch_size, global_batch_size
        self.device, self.autocast_dtype = device, autocast_dtype

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def forward_backward(self, batch: Batch) -> dict[str, Any]:
        inputs, targets = rank_rows(batch, self.dims)
        n_loss_tokens = global_count(int((targets != IGNORE_INDEX).sum()), self.dims)
        accumulation = inputs.shape[0] // self.mb
        micro_batches = accumulation * self.dims.dp_size
        local = StepStats()
        for i in range(accumulation):
            rows = slice(i * self.mb, (i + 1) * self.mb)
            x = inputs[rows].to(self.device, non_blocking=True)
            y = targets[rows].to(self.device, non_blocking=True)
            self._sync_gradients(i == accumulation - 1)
            with self._autocast():
                out = self.model(x)
            micro_sum = token_loss_sum(out.logits, y)
            micro_batch_objective(micro_sum, out.aux_loss, n_loss_tokens, micro_batches).backward()
            local.add_loss(micro_sum)
            local.add_routing(out)
        stats = reduce_over_ranks(local, self.dims)
        return step_result(stats, n_loss_tokens, micro_batches, int(batch.inputs.numel()))

    def _sync_gradients(self, last_micro_batch: bool) -> None:
        """Reduce gradients over data-parallel ranks in this backward only on the step's last micro-batch."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last_micro_batch, recurse=True)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for m in self.parts for p in m.parameters() if p.grad is not None]
        return float(clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, self.dims))

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        for m in self.parts:
            m.update_expert_bias({k: v.to(self.device) for k, v in counts.items()})

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """(sum of token losses, loss tokens) over the validation batches, summed over ranks."""
        total = torch.zeros((), dtype=torch.float64)
        n = 0
        for batch in batches:
            inputs, targets = rank_rows(padded_batch(batch, self.global_batch_size), self.dims)
            for i in range(0, inputs.shape[0], self.mb):
                x = inputs[i:i + self.mb].to(self.device)
                y = targets[i:i + self.mb].to(self.device)
                with self._autocast():
                    logits = self.model(x).logits
                total += token_loss_sum(logits, y).double().cpu()
                n += int((y != IGNORE_INDEX).sum())
        both = global_sum(torch.stack([total, torch.tensor(float(n), dtype=torch.float64)]), self.dims,
                          token_dim(self.dims))
        return float(both[0]), int(both[1])
