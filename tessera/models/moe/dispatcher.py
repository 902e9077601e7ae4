"""The token dispatcher seam (after Megatron-Core's MoE token dispatcher): `dispatch` sends each
kept routing slot's token to its expert, in expert order; `combine` brings the expert outputs
back, weighted by the gate, and sums them per token.

`LocalDispatcher` does this on one process with gathers (`index_select` to expert order,
`index_add` back to tokens) and never asks the host for a count: every shape is fixed by the
micro-batch (T*k slots; capacity drops move a slot to the end of the order and mask it rather
than removing it), so a step on a GPU runs without a device-to-host synchronisation and the
grouped GEMM's offsets stay on the device. Expert parallelism replaces it (from
`tessera.parallel`) with an all-to-all or all-gather one; the MoE layer never knows which it has.
The all-to-all needs each rank's row counts on the host (`all_to_all_single` split sizes): that
synchronisation is inherent to it. The helpers here do no communication: `sort_slots_by_expert`,
`sort_all_slots_by_expert`, `pad_rows_to_capacity`, `expert_slot_counts` and `gate_and_sum`.
T tokens, k slots per token, N kept slots, D model dim, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DispatchContext:
    token_index_N: torch.Tensor  # which token each dispatched row came from
    slot_index_N: torch.Tensor  # its flat index in the [T*k] routing slots (to find its gate weight)
    row_of_N: torch.Tensor | None = None  # row in the padded buffer, when padding to capacity
    num_tokens: int = 0
    keep_N: torch.Tensor | None = None  # [N] bool: the row is a kept slot (None: every row is)


class TokenDispatcher(Protocol):
    def dispatch(self, x_TD: torch.Tensor, indices_Tk: torch.Tensor, keep_Tk: torch.Tensor | None,
                 capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]: ...

    def combine(self, y_ND: torch.Tensor, weights_Tk: torch.Tensor, ctx: DispatchContext) -> torch.Tensor: ...


def sort_slots_by_expert(indices_Tk: torch.Tensor, keep_Tk: torch.Tensor | None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat slot index, expert) of every kept routing slot, in expert order (stable: token order
    within an expert)."""
    flat = indices_Tk.flatten()
    slots = torch.arange(flat.numel(), device=flat.device)
    if keep_Tk is not None:
        kept = keep_Tk.flatten()
        flat, slots = flat[kept], slots[kept]
    order = torch.argsort(flat, stable=True)
    return slots[order], flat[order]


def expert_slot_counts(experts_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of `experts_N` (ids in 0..E, E counting nothing) name each expert.
    A scatter-add, not `bincount`, whose output size depends on the data (a host sync on GPUs)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts_N.device)
    return counts.scatter_add_(0, experts_N, torch.ones_like(experts_N))[:num_experts]


def sort_all_slots_by_expert(indices_Tk: torch.Tensor, keep_Tk: torch.Tensor | None, num_experts: int,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(flat slot index [T*k], expert [T*k], kept [T*k] or None) of every routing slot in expert
    order (stable: token order within an expert), dropped slots last with expert id E. The kept
    slots come in the order `sort_slots_by_expert` gives them; the shapes never depend on the data."""
    flat = indices_Tk.flatten()
    kept = None
    if keep_Tk is not None:
        flat = torch.where(keep_Tk.flatten(), flat, num_experts)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    if keep_Tk is not None:
        kept = experts < num_experts
    return order, experts, kept


def pad_all_slots_to_capacity(rows_ND: torch.Tensor, experts_N: torch.Tensor, counts_E: torch.Tensor,
                              capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pad_rows_to_capacity` for the output of `sort_all_slots_by_expert`: a [E * capacity, D]
    buffer of the kept rows (dropped rows, expert id E, are written to a scratch row cut off after),
    and each row's place in it (0 for dropped rows, which `gate_and_sum` masks)."""
    E = counts_E.shape[0]
    starts = torch.cumsum(counts_E, 0) - counts_E
    kept = experts_N < E
    within = torch.arange(len(experts_N), device=rows_ND.device) - starts[experts_N.clamp(max=E - 1)]
    row_of_N = torch.where(kept, experts_N * capacity + within, E * capacity)
    buf = rows_ND.new_zeros(E * capacity + 1, rows_ND.shape[1]).index_copy(0, row_of_N, rows_ND)
    return buf[:E * capacity], torch.where(kept, row_of_N, 0)


def pad_rows_to_capacity(rows_ND: torch.Tensor, experts_N: torch.Tensor, num_experts: int, capacity: int,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """[E * capacity, D] buffer with expert e's rows (sorted by expert) first in block e, zeros
    after: the fixed shapes of capacity-based MoE; and each row's position in it."""
    counts = torch.bincount(experts_N, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(len(experts_N), device=rows_ND.device) - starts[experts_N]
    row_of_N = experts_N * capacity + within
    buf = rows_ND.new_zeros(num_experts * capacity, rows_ND.shape[1]).index_copy(0, row_of_N, rows_ND)
    return buf, row_of_N


def gate_and_sum(y_ND: torch.Tensor, weights_Tk: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
    """Weight every expert output row by its gate and add it to its token's output row: [T, D]."""
    if ctx.row_of_N is not None:
        y_ND = y_ND.index_select(0, ctx.row_of_N)
    if ctx.keep_N is not None:
        # Dropped slots' rows hold no expert output: whatever memory the grouped GEMM left there,
        # maybe not finite. They are zeroed before the gate multiplies them, whose backward reads
        # them for the gate's gradient (0 * NaN would be NaN; 0 * 0 is 0).
        y_ND = torch.where(ctx.keep_N[:, None], y_ND, 0)
    gate_N = weights_Tk.flatten()[ctx.slot_index_N]
    y_ND = (y_ND.float() * gate_N[:, None]).to(y_ND.dtype)
    return y_ND.new_zeros(ctx.num_tokens, y_ND.shape[1]).index_add(0, ctx.token_index_N, y_ND)


class LocalDispatcher:
    """All experts on this process. With `pad_to_capacity`, every expert gets exactly `capacity`
    rows (zeros after its tokens). Without it, a capacity's dropped slots are rows after the last
    expert's (zero input, no gradient, masked in `combine`), so the row count stays T*k."""

    def __init__(self, num_experts: int, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TD, indices_Tk, keep_Tk, capacity=None):
        T, k = indices_Tk.shape
        slots, experts, kept = sort_all_slots_by_expert(indices_Tk, keep_Tk, self.num_experts)
        ctx = DispatchContext(token_index_N=slots // k, slot_index_N=slots, num_tokens=T, keep_N=kept)
        rows = x_TD.index_select(0, ctx.token_index_N)
        counts = expert_slot_counts(experts, self.num_experts)
        if kept is not None:  # zero rows for dropped slots; `where` also stops their gradient
            rows = torch.where(kept[:, None], rows, 0)
        if not self.pad_to_capacity or capacity is None:
            return rows, counts, ctx
        buf, ctx.row_of_N = pad_all_slots_to_capacity(rows, experts, counts, capacity)
        return buf, torch.full((self.num_experts,), capacity, dtype=torch.int64, device=buf.device), ctx

    def combine(self, y_ND, weights_Tk, ctx):
        return gate_and_sum(y_ND, weights_Tk, ctx)
