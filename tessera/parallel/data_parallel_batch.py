"""Which part of the global batch a rank reads, and the sums over data-parallel ranks that the
numerics contract needs.

The global batch [G, ...] is cut into dp = dp_replicate x dp_shard equal, contiguous row blocks;
the rank at data-parallel coordinate d reads block d. Ranks that differ only in tp, pp (and cp,
which would further split the sequence) read the same block.

    loss_r = sum of token losses on rank r's rows / N_global + aux_r / M_global

with N_global the loss tokens of the whole global batch (`global_count` of the local counts) and
M_global the number of micro-batches over all data-parallel ranks. Gradients are summed across
data-parallel ranks (data_parallel.py), so the step's gradient is that of the global loss, and
`global_sum(loss_r)` is the value to log.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.config.errors import ParallelError
from tessera.parallel.dims import ParallelDims


def dp_rows(global_batch_size: int, dims: ParallelDims) -> slice:
    """The rows of the global batch this rank reads."""
    dp = dims.dp_size
    if global_batch_size % dp:
        raise ParallelError(f"dp={dp} (dp_replicate x dp_shard) does not divide the global batch size "
                            f"{global_batch_size}")
    per_rank = global_batch_size // dp
    start = (dims.dp_rank if dp > 1 else 0) * per_rank
    return slice(start, start + per_rank)


def shard_global_batch(batch: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's rows of a global-batch tensor [G, ...]."""
    return batch[dp_rows(batch.shape[0], dims)]


def global_sum(value: torch.Tensor | float | int, dims: ParallelDims, dim: str = "dp") -> torch.Tensor:
    """Sum of a per-rank value over the data-parallel ranks (a detached fp64 scalar or tensor)."""
    t = torch.as_tensor(value).detach().clone().to(torch.float64)
    if dims.size(dim) > 1:
        dist.all_reduce(t, group=dims[dim].get_group())
    return t


def global_count(local_count: int, dims: ParallelDims) -> int:
    """Loss tokens of the whole global batch from each rank's count of its own rows."""
    return int(global_sum(local_count, dims).item())


def sum_expert_counts(counts: dict[int, torch.Tensor], dims: ParallelDims) -> dict[int, torch.Tensor]:
    """Routing counts summed over data-parallel ranks, so that every rank takes the same
    aux-loss-free expert-bias step (`Transformer.update_expert_bias`)."""
    if dims.dp_size == 1 or not counts:
        return counts
    keys = sorted(counts)
    stacked = torch.stack([counts[k].to(torch.int64) for k in keys])
    dist.all_reduce(stacked, group=dims["dp"].get_group())
    return {k: stacked[i] for i, k in enumerate(keys)}
