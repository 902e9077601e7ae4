"""Token dispatchers for expert parallelism: the communicating side of the MoE dispatcher seam
(`tessera.models.moe.dispatcher.TokenDispatcher`).

Experts are split over the `ep` ranks in contiguous blocks: rank r owns experts
[r * E/ep, (r+1) * E/ep). Two interchangeable dispatchers (after Megatron-Core's):

- `AllToAllDispatcher` (GShard, Lepikhin et al. 2020): each rank sorts its routing slots by
  expert, exchanges the per-expert counts, then sends every row straight to the rank owning its
  expert with one uneven `all_to_all_single`; `combine` sends the outputs back the same way.
  Traffic is proportional to the routed rows only. With `pad_to_capacity` every expert gets
  exactly `capacity` rows and the exchange is even (GShard's fixed shapes).
- `AllGatherDispatcher`: every rank gathers all tokens of the group and runs its own experts on
  the rows routed to them; `combine` reduce-scatters the summed outputs back. Simpler, more
  traffic (every token goes everywhere); needs the same token count on every rank.

Expert tensor parallelism: under tp > 1 every tp rank holds all the micro-batch's tokens and a
1/tp slice of every local expert's hidden dimension (w1/w3 split along F like column-parallel,
w2 like row-parallel), so each rank's expert output is a partial sum. The dispatcher makes the
rows sent to experts "copy to tp" (gradients summed over tp) and sums the expert outputs over
tp *before* they are gated, so the router's gate gradient sees full outputs on every tp rank.

Sorting slots by expert, padding to capacity and gating are the local dispatcher's own helpers
(`tessera.models.moe.dispatcher`); only the exchanges are added here.

An expert that receives no rows (on a rank, or at all) simply computes on zero rows; its weight
gradient is zero. T tokens, k slots per token, N dispatched rows, D model dim, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tessera.config.errors import ParallelError
from tessera.models.moe.dispatcher import DispatchContext, gate_and_sum, pad_rows_to_capacity, sort_slots_by_expert
from tessera.parallel.collectives import (
    all_to_all_counts,
    all_to_all_rows,
    copy_to_group,
    gather_rows,
    reduce_from_group,
    reduce_scatter_rows,
)


def _group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class _ExpertGroups:
    """What both dispatchers know: the expert and tensor-parallel groups and this rank's experts."""

    num_experts: int
    ep_group: ProcessGroup | None
    tp_group: ProcessGroup | None = None
    ep: int = field(init=False)  # ranks the experts are split over
    local_experts: int = field(init=False)  # experts on this rank: [rank * local_experts, +local_experts)

    def __post_init__(self) -> None:
        self.ep = _group_size(self.ep_group)
        if self.num_experts % self.ep:
            raise ParallelError(f"ep={self.ep} does not divide moe.num_experts={self.num_experts}")
        self.local_experts = self.num_experts // self.ep


@dataclass
class AllToAllContext(DispatchContext):
    send_splits: list[int] = field(default_factory=list)  # rows this rank sent to each ep rank
    recv_splits: list[int] = field(default_factory=list)  # rows it received from each ep rank
    regroup: torch.Tensor | None = None  # received rows (by source rank) -> rows by local expert


@dataclass
class AllToAllDispatcher(_ExpertGroups):
    """Dispatch with one uneven all-to-all over `ep_group` (None: experts all local, e.g. tensor
    parallelism of experts without expert parallelism)."""

    pad_to_capacity: bool = False
    # parallel.ep_dispatch_dtype=compute: under autocast the rows cross in the autocast dtype and come back
    # to the input's on arrival (the experts' products cast to the autocast dtype again: the same values)
    send_in_compute_dtype: bool = False

    def dispatch(self, x_TD, indices_Tk, keep_Tk, capacity=None):
        T, k = indices_Tk.shape
        slots, experts = sort_slots_by_expert(indices_Tk, keep_Tk)
        ctx = AllToAllContext(token_index_N=slots // k, slot_index_N=slots, num_tokens=T)
        rows = copy_to_group(x_TD[ctx.token_index_N], self.tp_group)
        if self.pad_to_capacity and capacity is not None:
            rows, ctx.row_of_N = pad_rows_to_capacity(rows, experts, self.num_experts, capacity)
            send_counts = torch.full((self.num_experts,), capacity, dtype=torch.int64, device=rows.device)
        else:
            send_counts = torch.bincount(experts, minlength=self.num_experts)
        if self.ep == 1:
            return rows, send_counts, ctx
        # How many rows of each of my experts every source rank sends me: [ep, local_experts].
        recv_counts = all_to_all_counts(send_counts, self.ep_group).view(self.ep, self.local_experts)
        ctx.send_splits = send_counts.view(self.ep, self.local_experts).sum(1).tolist()
        ctx.recv_splits = recv_counts.sum(1).tolist()
        received = self._send_rows(rows, ctx)
        # Received rows come grouped by source rank, then expert; experts want theirs contiguous.
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local_experts, device=rows.device).repeat(self.ep), recv_counts.flatten())
        ctx.regroup = torch.argsort(expert_of_row, stable=True)
        return received[ctx.regroup], recv_counts.sum(0), ctx

    def _send_rows(self, rows: torch.Tensor, ctx: AllToAllContext) -> torch.Tensor:
        device = rows.device.type
        if not (self.send_in_compute_dtype and torch.is_autocast_enabled(device)):
            return all_to_all_rows(rows, ctx.recv_splits, ctx.send_splits, self.ep_group)
        sent = rows.to(torch.get_autocast_dtype(device))
        return all_to_all_rows(sent, ctx.recv_splits, ctx.send_splits, self.ep_group).to(rows.dtype)

    def combine(self, y_ND, weights_Tk, ctx):
        if ctx.regroup is not None:
            by_source = y_ND.index_select(0, torch.argsort(ctx.regroup))
            y_ND = all_to_all_rows(by_source, ctx.send_splits, ctx.recv_splits, self.ep_group)
        y_ND = reduce_from_group(y_ND, self.tp_group)
        return gate_and_sum(y_ND, weights_Tk, ctx)


@dataclass
class AllGatherContext(DispatchContext):
    local_tokens: int = 0


@dataclass
class AllGatherDispatcher(_ExpertGroups):
    """Dispatch by gathering every rank's tokens; each rank computes its own experts' rows."""

    def dispatch(self, x_TD, indices_Tk, keep_Tk, capacity=None):
        T, k = indices_Tk.shape
        x_all = gather_rows(x_TD, self.ep_group)  # [ep*T, D]; every rank must hold T tokens
        with torch.no_grad():
            idx_all = gather_rows(indices_Tk, self.ep_group)
            keep_all = None if keep_Tk is None else gather_rows(keep_Tk.to(torch.uint8), self.ep_group).bool()
        first = _group_rank(self.ep_group) * self.local_experts
        mine = (idx_all >= first) & (idx_all < first + self.local_experts)
        keep_mine = mine if keep_all is None else mine & keep_all
        slots, experts = sort_slots_by_expert(idx_all - first, keep_mine)
        ctx = AllGatherContext(token_index_N=slots // k, slot_index_N=slots, num_tokens=x_all.shape[0],
                               local_tokens=T)
        rows = copy_to_group(x_all[ctx.token_index_N], self.tp_group)
        return rows, torch.bincount(experts, minlength=self.local_experts), ctx

    def combine(self, y_ND, weights_Tk, ctx):
        y_ND = reduce_from_group(y_ND, self.tp_group)
        weights_all = gather_rows(weights_Tk, self.ep_group)
        out_all = gate_and_sum(y_ND, weights_all, ctx)  # [ep*T, D]: my experts' share of every token
        return reduce_scatter_rows(out_all, self.ep_group)
