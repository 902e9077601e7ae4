"""The token dispatcher seam (after Megatron-Core's MoE token dispatcher): `dispatch` sends each
kept routing slot's token to its expert, in expert order; `combine` brings the expert outputs
back, weighted by the gate, and sums them per token.

`LocalDispatcher` does this on one process with a permutation. Expert parallelism replaces it
(from `tessera.parallel`) with an all-to-all or all-gather one; the MoE layer never knows which it
has. Both build on the helpers here, which do no communication: `sort_slots_by_expert`,
`pad_rows_to_capacity` and `gate_and_sum`.
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
        y_ND = y_ND[ctx.row_of_N]
    gate_N = weights_Tk.flatten()[ctx.slot_index_N]
    y_ND = (y_ND.float() * gate_N[:, None]).to(y_ND.dtype)
    return y_ND.new_zeros(ctx.num_tokens, y_ND.shape[1]).index_add(0, ctx.token_index_N, y_ND)


class LocalDispatcher:
    """All experts on this process. With `pad_to_capacity`, every expert gets exactly `capacity`
    rows (zeros after its tokens)."""

    def __init__(self, num_experts: int, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TD, indices_Tk, keep_Tk, capacity=None):
        T, k = indices_Tk.shape
        slots, experts = sort_slots_by_expert(indices_Tk, keep_Tk)
        ctx = DispatchContext(token_index_N=slots // k, slot_index_N=slots, num_tokens=T)
        rows = x_TD[ctx.token_index_N]
        if not self.pad_to_capacity or capacity is None:
            return rows, torch.bincount(experts, minlength=self.num_experts), ctx
        buf, ctx.row_of_N = pad_rows_to_capacity(rows, experts, self.num_experts, capacity)
        return buf, torch.full((self.num_experts,), capacity, dtype=torch.int64, device=buf.device), ctx

    def combine(self, y_ND, weights_Tk, ctx):
        return gate_and_sum(y_ND, weights_Tk, ctx)
