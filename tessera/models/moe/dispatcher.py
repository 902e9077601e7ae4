"""The token dispatcher seam (after Megatron-Core's MoE token dispatcher): `dispatch` sends each
kept routing slot's token to its expert, in expert order; `combine` brings the expert outputs
back, weighted by the gate, and sums them per token.

`LocalDispatcher` does this on one process with a permutation. Expert parallelism replaces it
(from `tessera.parallel`) with an all-to-all one; the MoE layer never knows which it has.
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


class LocalDispatcher:
    """All experts on this process. With `pad_to_capacity`, every expert gets exactly `capacity`
    rows (zeros after its tokens): the fixed shapes of capacity-based MoE."""

    def __init__(self, num_experts: int, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TD, indices_Tk, keep_Tk, capacity=None):
        T, k = indices_Tk.shape
        flat = indices_Tk.flatten()
        slots = torch.arange(T * k, device=flat.device)
        if keep_Tk is not None:
            kept = keep_Tk.flatten()
            flat, slots = flat[kept], slots[kept]
        order = torch.argsort(flat, stable=True)
        slots, experts = slots[order], flat[order]
        counts = torch.bincount(experts, minlength=self.num_experts)
        ctx = DispatchContext(token_index_N=slots // k, slot_index_N=slots, num_tokens=T)
        rows = x_TD[ctx.token_index_N]
        if not self.pad_to_capacity or capacity is None:
            return rows, counts, ctx
        # Position of each row inside its expert's block, then its row in the [E * pad_to] buffer.
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(len(experts), device=flat.device) - starts[experts]
        ctx.row_of_N = experts * capacity + within
        buf = x_TD.new_zeros(self.num_experts * capacity, x_TD.shape[1])
        buf = buf.index_copy(0, ctx.row_of_N, rows)
        return buf, torch.full_like(counts, capacity), ctx

    def combine(self, y_ND, weights_Tk, ctx):
        if ctx.row_of_N is not None:
            y_ND = y_ND[ctx.row_of_N]
        gate_N = weights_Tk.flatten()[ctx.slot_index_N]
        y_ND = (y_ND.float() * gate_N[:, None]).to(y_ND.dtype)
        out = y_ND.new_zeros(ctx.num_tokens, y_ND.shape[1])
        return out.index_add(0, ctx.token_index_N, y_ND)
