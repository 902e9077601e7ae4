"""Communication operators as small autograd functions.

Each forward collective has the backward that is its transpose:

- `copy_to_group`     identity / all-reduce     Megatron-LM's "f" (Shoeybi et al. 2019, section 3):
                                                 one input feeds every rank's partial computation.
- `reduce_from_group` all-reduce / identity     Megatron-LM's "g": partial results are summed.
- `all_to_all_rows`   all-to-all / all-to-all   GShard's dispatch (Lepikhin et al. 2020): rows go
                                                 to their owner; the gradient comes back the same way
                                                 with the split sizes swapped.
- `gather_rows`       all-gather / reduce-scatter along dim 0 (equal sizes on every rank).
- `reduce_scatter_rows` reduce-scatter / all-gather along dim 0.
- `gather_rows_then`  fn(all-gathered rows) / fn's backward, then reduce-scatter: one node whose
                      backward runs on every rank even where fn's result ignores the gathered rows
                      (a rank's share of the gradient is then zero, but its collective still runs).
- `split_rows`        keep this rank's block / all-gather along dim 0: Megatron-LM's scatter to the
                      sequence-parallel region (Korthikanti et al. 2022), for a tensor every rank
                      holds whole.

Lanes: two threads of one rank may each run collectives of their own at once (the forward and the
backward of DualPipeV's overlapped pairs, pipeline_overlap.py); ranks must never interleave two
threads' collectives on one process group. Every collective here (forward and backward) and the
expert dispatcher's count exchange resolve their group through `lane_group`: on a thread that
entered `lane(twins)`, a group with a twin (the same ranks, another communicator) becomes the twin.
Outside a lane (every run but the overlapped pairs) nothing changes.

All of them are the identity on a group of one rank and take `group=None` as that case. Inside a
torch.compile'd region (`train.compile`) they run eagerly, between the compiled graphs: traced, the
result a backward's collective writes into a fresh buffer was lost under torch 2.11 (context-parallel
gradients came out wrong while the loss was right).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tessera.parallel.memory.kept_exchange import exchange_counts, exchange_rows

_lanes = threading.local()


@contextmanager
def lane(twins: dict[ProcessGroup, ProcessGroup]) -> Iterator[None]:
    """On this thread, until the block ends, every group with an entry in `twins` is replaced by it."""
    before = getattr(_lanes, "twins", None)
    _lanes.twins = twins
    try:
        yield
    finally:
        _lanes.twins = before


def lane_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """The group this thread's collectives over `group` use: its twin inside a `lane`, else itself."""
    twins = getattr(_lanes, "twins", None)
    return group if twins is None or group is None else twins.get(group, group)


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=lane_group(ctx.group))
        return g, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=lane_group(group))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=lane_group(group))
        return out

    @staticmethod
    def backward(ctx, g):
        output_splits, input_splits = ctx.splits
        grad = g.new_empty((sum(input_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(grad, g.contiguous(), input_splits, output_splits,
                                group=lane_group(ctx.group))
        return grad, None, None, None


def _all_gather_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0 in rank order, into a fresh buffer."""
    out = x.new_empty((x.shape[0] * _size(group),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=lane_group(group))
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal block of dim 0 of the sum of every rank's `x`, into a fresh buffer."""
    n = _size(group)
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=lane_group(group))
    return out


def _own_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal block of dim 0 of `x`, which every rank holds whole (no communication)."""
    return x.chunk(_size(group))[dist.get_rank(group)].contiguous()


class _Rows(torch.autograd.Function):
    """A collective along dim 0 whose backward is its transpose: `forward_op(x, group)` forward,
    `backward_op(g, group)` backward (the gather, reduce-scatter and split of rows)."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_op(g, ctx.group), None, None, None


class _GatheredThen(torch.autograd.Function):
    """fn(*every tensor's rows gathered over the group); backward: fn's backward (recomputed), then
    the reduce-scatter of each gathered tensor's gradient."""

    @staticmethod
    def forward(ctx, fn, group, *tensors):
        gathered = [_all_gather_rows(t, group) for t in tensors]
        ctx.fn, ctx.group = fn, group
        ctx.save_for_backward(*gathered)
        return fn(*gathered)

    @staticmethod
    def backward(ctx, g):
        gathered = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*gathered)
        if out.requires_grad:
            grads = torch.autograd.grad(out, gathered, g, allow_unused=True, materialize_grads=True)
        else:  # fn read none of the gathered rows (this rank's parts start the sequence): zero gradients
            grads = [torch.zeros_like(t) for t in gathered]
        return (None, None, *(_reduce_scatter_rows(grad, ctx.group) for grad in grads))


@torch.compiler.disable
def _eager(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)`, never traced (see above): forward and backward run eagerly."""
    return function.apply(*args)


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward identity; backward sums the gradient over the group."""
    return x if _size(group) == 1 else _eager(_CopyToGroup, x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward sums over the group; backward passes the (replicated) gradient through."""
    return x if _size(group) == 1 else _eager(_ReduceFromGroup, x, group)


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Send rows input_splits[r] to rank r, receive output_splits[r] rows from rank r (uneven). Under a
    kept dispatch (memory/kept_exchange.py) a block's replay takes the forward's received rows instead."""
    if _size(group) == 1:
        return x
    return exchange_rows(x, lambda rows: _eager(_AllToAllRows, rows, output_splits, input_splits, group))


def all_to_all_counts(send_counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's `send_counts` block for this rank (an even all-to-all of counts, no gradient); under a
    kept dispatch a block's replay takes the forward's."""
    def send(counts: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=lane_group(group))
        return received

    return exchange_counts(send_counts, send)


def gather_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (every rank must hold the same number)."""
    return x if _size(group) == 1 else _eager(_Rows, x, group, _all_gather_rows, _reduce_scatter_rows)


def gather_rows_then(fn, group: ProcessGroup | None, *tensors: torch.Tensor) -> torch.Tensor:
    """fn(*(every rank's rows of each tensor, in rank order)), a tensor; differentiable in the tensors,
    whose backward runs the reduce-scatters on every rank whatever fn reads of the gathered rows."""
    return fn(*tensors) if _size(group) == 1 else _eager(_GatheredThen, fn, group, *tensors)


def reduce_scatter_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the group, then keep this rank's equal block of rows."""
    return x if _size(group) == 1 else _eager(_Rows, x, group, _reduce_scatter_rows, _all_gather_rows)


def split_rows(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal block of the rows of `x`, which every rank of the group holds whole; the
    gradient comes back whole on every rank (all-gathered)."""
    return x if _size(group) == 1 else _eager(_Rows, x, group, _own_rows, _all_gather_rows)
