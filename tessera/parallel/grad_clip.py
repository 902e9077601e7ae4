"""Gradient-norm clipping over a model split across ranks.

The norm must cover every parameter of the whole model exactly once, however it is split: a
DTensor's shards live on different ranks (sum them), its replicas on others (count one), plain
tensors are replicated over every rank of their pipeline stage (count one), and pipeline stages
hold different parameters (sum them). Each rank adds |g|^p of the local pieces it is
responsible for: a gradient still a partial sum over some mesh dimension (a sequence-parallel
norm's weight under sp: each rank's share of the sequence) is summed over it first, then a piece
counts on this rank iff this rank's coordinate is 0 along every mesh dimension (except pp) over
which that piece is replicated. One all-reduce over the world then
gives sum |g|^p of the full model, identical on every rank. A parameter held twice under one
name by two pipeline stages (tied embeddings, tied_embeddings.py) is clipped on both and counted
on one: the other copy is passed as `uncounted`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tessera.parallel.dims import BASE_DIMS, FLAT_DIMS, ParallelDims


def _base_dims(mesh_dim_name: str) -> tuple[str, ...]:
    return FLAT_DIMS.get(mesh_dim_name, (mesh_dim_name,))


def counts_on_this_rank(grad: torch.Tensor, coords: dict[str, int]) -> bool:
    """Whether this rank adds `grad`'s local piece to the norm (see module docstring)."""
    sharded: set[str] = set()
    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, grad.placements):
            if not placement.is_replicate():  # Shard, or FSDP's _StridedShard (not a Shard subclass)
                sharded.update(_base_dims(name))
    return all(coords[d] == 0 for d in BASE_DIMS if d != "pp" and d not in sharded)


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.Tensor], dims: ParallelDims | None = None,
              norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of the gradients of the whole model (fp32 scalar, same on every rank)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    distributed = dims is not None and dims.mesh is not None and dims.world_size > 1
    coords = dims.coordinates() if distributed else None
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):  # a collective: every rank, in order
            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
        if coords is not None and not counts_on_this_rank(g, coords):
            continue
        local = (g.to_local() if isinstance(g, DTensor) else g).float()
        if local.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, local.abs().max())
        else:
            total += local.abs().pow(norm_type).sum()
    if distributed:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, dims: ParallelDims | None = None,
                    norm_type: float = 2.0, uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale all gradients so the whole model's gradient norm is at most `max_norm`; returns the
    norm before clipping (as torch.nn.utils.clip_grad_norm_ does). Parameters in `uncounted` are
    clipped but left out of the norm (a second copy of one counted elsewhere)."""
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    norm = grad_norm([p for p in params if id(p) not in skip], dims, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return norm
