"""Hidden-state matching between chosen layers of a student and its distillation teacher
(`train.distill.hidden_layers`, `train.distill.hidden_weight`), through a learned projection.

For each pair (i, j) of `hidden_layers` the output of the student's block i, h_s [B, S, D_s], is
mapped by its own learned linear map W_ij [D_t, D_s] (no bias) to the teacher's width and compared
with the output of the teacher's block j, h_t [B, S, D_t], over the loss tokens t of the
micro-batch (the tokens the data loss counts):

    hidden_sum = sum over pairs, over t of mean_c (W_ij h_s,t - h_t,t)_c^2      (MSE per token, in fp32)

and the objective adds hidden_weight * hidden_sum / N (N: loss tokens of the global batch, as for
the other terms: tessera.train.objectives.distill_loss), logged as `distill_hidden_loss` = hidden_sum / N.
Matching hidden states through a learned projection is FitNets' hint loss (Romero et al. 2015)
as Minitron uses it on intermediate states (Muralidharan et al. 2024); the MSE (rather than a
cosine) keeps the scale of the teacher's residual stream, which the student is meant to follow.

The projections are trained with the student (their own AdamW over the same hyper-parameters and
learning-rate schedule, stepped with the student's optimizers) but belong to neither model: they
are not in the student's checkpoints or its HuggingFace export (a resumed run starts them afresh
from `train.seed`), and the gradient norm the trainer clips and logs is the student's alone.
They start from a normal(0, 1/sqrt(D_s)) draw of their own generator (seeded from `train.seed`),
which draws nothing from the run's random stream. On data-parallel ranks (dp_replicate, dp_shard)
every rank holds them whole and their gradients are summed over the ranks once per step
(`reduce_gradients`); other layouts are refused by the config (tessera.config.schema).

The block outputs are read by forward hooks on the blocks (`layers[i]` of each model), the way the
pipeline engine reads its stages' routing statistics; `loss_sum` consumes what they read.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config.schema import OptimConfig
from tessera.parallel import global_sum, token_dim
from tessera.parallel.dims import ParallelDims
from tessera.train.objectives.loss import IGNORE_INDEX
from tessera.train.optimizer import build_optimizer

SEED_OFFSET = 0x6869  # the projections' generator: train.seed + this, apart from every other draw


class HiddenMatch(nn.Module):
    """The learned projections of `pairs` (student layer, teacher layer), their AdamW (`optimizer`,
    with the student's `optim` hyper-parameters) and the block outputs of the current micro-batch,
    read by hooks on `student` and `teacher`."""

    def __init__(self, pairs: list[tuple[int, int]], student: nn.Module, teacher: nn.Module,
                 student_dim: int, teacher_dim: int, seed: int, device: torch.device, optim: OptimConfig):
        super().__init__()
        self.pairs = [(int(i), int(j)) for i, j in pairs]
        gen = torch.Generator().manual_seed(seed + SEED_OFFSET)
        self.projections = nn.ModuleDict()
        for i, j in self.pairs:
            proj = nn.Linear(student_dim, teacher_dim, bias=False)
            with torch.no_grad():
                proj.weight.copy_(torch.randn(teacher_dim, student_dim, generator=gen) / math.sqrt(student_dim))
            self.projections[f"{i}_{j}"] = proj.to(device)
        self.optimizer = build_optimizer(self, optim)
        self._student: dict[int, torch.Tensor] = {}
        self._teacher: dict[int, torch.Tensor] = {}
        for i in {i for i, _ in self.pairs}:
            student.layers[str(i)].register_forward_hook(self._reader(self._student, i))
        for j in {j for _, j in self.pairs}:
            teacher.layers[str(j)].register_forward_hook(self._reader(self._teacher, j))

    @staticmethod
    def _reader(into: dict[int, torch.Tensor], layer: int):
        def read(module: nn.Module, args: tuple, out: tuple) -> None:
            into[layer] = out[0]  # a block returns (hidden states, router output)
        return read

    def loss_sum(self, targets: torch.Tensor) -> torch.Tensor:
        """hidden_sum (module docstring) of the micro-batch whose blocks ran last, over the tokens
        whose target is not IGNORE_INDEX; forgets the block outputs it read."""
        keep_N = targets.reshape(-1) != IGNORE_INDEX
        total = torch.zeros((), dtype=torch.float32, device=targets.device)
        for i, j in self.pairs:
            h_s = self._student[i].float().reshape(-1, self._student[i].shape[-1])[keep_N]
            h_t = self._teacher[j].float().reshape(-1, self._teacher[j].shape[-1])[keep_N]
            mapped = h_s @ self.projections[f"{i}_{j}"].weight.float().T  # [N, D_t]
            total = total + (mapped - h_t).pow(2).mean(dim=-1).sum()
        self._student.clear()
        self._teacher.clear()
        return total

    def reduce_gradients(self, dims: ParallelDims) -> None:
        """Sum the projections' gradients over the data-parallel ranks (each rank saw its own rows)."""
        for p in self.parameters():
            if p.grad is not None:
                p.grad.copy_(global_sum(p.grad, dims, token_dim(dims)).to(p.grad.dtype))
