"""Which part of the global batch a rank reads, and the sums over data-parallel ranks that the
numerics contract needs.

The global batch [G, ...] is cut into dp = dp_replicate x dp_shard equal, contiguous row blocks;
the rank at data-parallel coordinate d reads block d. Ranks that differ only in tp or pp read the
same block; under context parallelism (cp > 1) the cp ranks of a block split every sequence of it
by `dims.cp_layout` (sequence_layout.py): cp contiguous chunks, rank r reading chunk r, or 2 cp
chunks, rank r reading chunks r and 2 cp - 1 - r (zig-zag) (`shard_global_batch`).

    loss_r = sum of token losses on rank r's tokens / N_global + aux_r / M_global

with N_global the loss tokens of the whole global batch (`global_count` of the local counts, summed
over every rank that holds different tokens: `token_dim`) and M_global the number of micro-batches
over all data-parallel ranks (cp ranks share theirs: each holds a part of the micro-batch's
auxiliary loss). Gradients are summed across data-parallel and cp ranks (data_parallel.py), so the
step's gradient is that of the global loss, and `global_sum(loss_r, dims, token_dim(dims))` is the
value to log.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.config.errors import ParallelError
from tessera.parallel.dims import ParallelDims
from tessera.parallel.sequence_layout import take_rank_tokens


def dp_rows(global_batch_size: int, dims: ParallelDims) -> slice:
    """The rows of the global batch this rank reads."""
    dp = dims.dp_size
    if global_batch_size % dp:
        raise ParallelError(f"dp={dp} (dp_replicate x dp_shard) does not divide the global batch size "
                            f"{global_batch_size}")
    per_rank = global_batch_size // dp
    start = (dims.dp_rank if dp > 1 else 0) * per_rank
    return slice(start, start + per_rank)


def token_dim(dims: ParallelDims) -> str:
    """The mesh dimension whose ranks hold different tokens: dp, or dp_cp under context parallelism."""
    return "dp_cp" if dims.cp > 1 else "dp"


def sequence_chunk(x: torch.Tensor, dims: ParallelDims, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of `x` along the sequence dimension `dim` under `dims.cp_layout` (all of
    it for cp = 1)."""
    if dims.cp == 1:
        return x
    return take_rank_tokens(x, dims.cp, dims.local_rank("cp"), dims.cp_layout, dim)


def shard_global_batch(batch: torch.Tensor, dims: ParallelDims, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a global-batch tensor [G, S, ...]: its rows and, under cp, its tokens of
    every sequence along `seq_dim` (give it inputs and targets [G, S], not the [G, S + 1] tokens)."""
    return sequence_chunk(batch[dp_rows(batch.shape[0], dims)], dims, seq_dim)


def global_sum(value: torch.Tensor | float | int, dims: ParallelDims, dim: str = "dp") -> torch.Tensor:
    """Sum of a per-rank value over the data-parallel ranks (a detached fp64 scalar or tensor)."""
    t = torch.as_tensor(value).detach().clone().to(torch.float64)
    if dims.size(dim) > 1:
        dist.all_reduce(t, group=dims[dim].get_group())
    return t


def global_count(local_count: int, dims: ParallelDims) -> int:
    """Loss tokens of the whole global batch from each rank's count of its own tokens."""
    return int(global_sum(local_count, dims, token_dim(dims)).item())


def sum_expert_counts(counts: dict[int, torch.Tensor], dims: ParallelDims) -> dict[int, torch.Tensor]:
    """Routing counts summed over data-parallel ranks, so that every rank takes the same
    aux-loss-free expert-bias step (`Transformer.update_expert_bias`). Not over cp: the router's
    counts are already those of the whole micro-batch (its cp count reducer summed them)."""
    if dims.dp_size == 1 or not counts:
        return counts
    keys = sorted(counts)
    stacked = torch.stack([counts[k].to(torch.int64) for k in keys])
    dist.all_reduce(stacked, group=dims["dp"].get_group())
    return {k: stacked[i] for i, k in enumerate(keys)}
