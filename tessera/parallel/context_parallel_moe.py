"""MoE statistics over the whole micro-batch when context parallelism spreads its tokens: expert
capacity (`MicroBatchKeepMask`) and Sinkhorn's column sums (`MicroBatchTokenReducer`).

With a capacity factor, an expert keeps at most `capacity` routing slots of a micro-batch and
drops the rest, by lowest gate weight or latest position (capacity.py). Under cp each rank routes
only its chunk of every sequence; deciding drops on the chunk alone would keep different slots
than one process does. `MicroBatchKeepMask`, installed as the MoE layer's `keep_mask` seam
(tessera.models.moe.capacity), gathers the (small) routing decisions of all cp ranks, [T, k]
expert ids and gate weights, puts them back into the micro-batch's token order (b-major, then
position, whatever the cp layout), takes the single-device keep-or-drop decision on them and keeps
its own tokens' rows of it. The capacity itself is computed from the micro-batch's token count, which the router's cp
count reducer already sums. Everything else is the MoE layer's own forward.

Sinkhorn routing normalises the columns of the [T, E] assignment over all the micro-batch's
tokens; `MicroBatchTokenReducer`, installed as the router's `reduce_over_tokens` seam
(tessera.models.moe.sinkhorn), all-reduces those column sums and maxima (and T and the
convergence error) over cp. The sequence-level balancing loss needs each whole sequence's routing
counts; the router's count reducer (`MicroBatchCountReducer`) sums them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tessera.models.moe.capacity import capacity_keep_mask
from tessera.parallel.sequence_layout import take_rank_tokens, to_sequence_order


def _gather_chunks(x_Tk: torch.Tensor, B: int, cp: int, layout: str, group: ProcessGroup) -> torch.Tensor:
    """Every cp rank's [B*C, k] -> the micro-batch's [B*S, k] in one-process token order."""
    out = x_Tk.new_empty((cp * x_Tk.shape[0],) + tuple(x_Tk.shape[1:]))
    dist.all_gather_into_tensor(out, x_Tk.contiguous(), group=group)
    k = x_Tk.shape[-1]
    return to_sequence_order(out.view(cp, B, -1, k), layout).reshape(-1, k)


@torch.no_grad()
def micro_batch_keep_mask(indices_Tk: torch.Tensor, weights_Tk: torch.Tensor, B: int, num_experts: int,
                          capacity: int, policy: str, cp_rank: int, cp: int, group: ProcessGroup,
                          layout: str = "contiguous") -> torch.Tensor:
    """Boolean [B*C, k] for this rank's tokens: the slots one process would keep for the micro-batch."""
    keep = capacity_keep_mask(_gather_chunks(indices_Tk, B, cp, layout, group),
                              _gather_chunks(weights_Tk.float(), B, cp, layout, group), num_experts, capacity,
                              policy)
    k = indices_Tk.shape[-1]
    return take_rank_tokens(keep.view(B, -1, k), cp, cp_rank, layout).reshape(-1, k)


class MicroBatchTokenReducer:
    """The router's `reduce_over_tokens` under cp: a detached sum or max over the cp group."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def __call__(self, x: torch.Tensor, op: str) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return out


class MicroBatchKeepMask:
    """The MoE layer's `keep_mask` under cp: the slots one process keeps for the whole micro-batch,
    this rank's tokens of them (split by `layout`, sequence_layout.py)."""

    def __init__(self, group: ProcessGroup, cp_rank: int, cp: int, layout: str = "contiguous"):
        self.group, self.cp_rank, self.cp, self.layout = group, cp_rank, cp, layout

    def __call__(self, indices_Tk: torch.Tensor, weights_Tk: torch.Tensor, batch_shape: tuple[int, int],
                 num_experts: int, capacity: int, policy: str) -> torch.Tensor:
        return micro_batch_keep_mask(indices_Tk, weights_Tk, batch_shape[0], num_experts, capacity, policy,
                                     self.cp_rank, self.cp, self.group, self.layout)
