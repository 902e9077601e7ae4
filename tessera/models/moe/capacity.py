"""Expert capacity and token dropping (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021).

capacity = ceil(T k / E * capacity_factor) routing slots per expert, over all the tokens of a
micro-batch. Slots beyond capacity are dropped: by lowest gate weight ("probs", Megatron's
default) or latest position in the micro-batch ("position", GShard/Switch). A dropped slot
contributes nothing; the token still keeps its other experts and the residual path.

The keep-or-drop decision is a seam of the MoE layer (`MoE.keep_mask`, a `KeepMask`): on one
process it is `local_keep_mask`; when context parallelism spreads a micro-batch's tokens over
ranks, `tessera.parallel` installs one that decides over the whole micro-batch, so the same slots
are dropped under every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# (expert ids [T, k], gate weights [T, k], (B, S) of these tokens, experts E, capacity, drop policy)
# -> boolean [T, k], True for the slots this process's tokens keep.
KeepMask = Callable[[torch.Tensor, torch.Tensor, tuple[int, int], int, int, str], torch.Tensor]


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def capacity_keep_mask(indices_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_experts: int, capacity: int,
                       policy: str = "probs") -> torch.Tensor:
    """Boolean [T, k]: True for the routing slots that fit in their expert's capacity."""
    T, k = indices_Tk.shape
    routed_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=indices_Tk.device)
    routed_TE.scatter_(1, indices_Tk, True)
    if policy == "position":
        rank_TE = routed_TE.long().cumsum(dim=0)  # 1-based arrival order per expert
        keep_TE = routed_TE & (rank_TE <= capacity)
    elif policy == "probs":
        gate_TE = torch.zeros(T, num_experts, device=indices_Tk.device).scatter_(1, indices_Tk, weights_Tk.float())
        gate_TE = gate_TE.masked_fill(~routed_TE, -1.0)
        top = gate_TE.topk(min(capacity, T), dim=0).indices  # [capacity, E]: best tokens per expert
        keep_TE = torch.zeros_like(routed_TE).scatter_(0, top, True) & routed_TE
    else:
        raise ValueError(f"drop policy must be probs or position, got {policy!r}")
    return keep_TE.gather(1, indices_Tk)


def local_keep_mask(indices_Tk: torch.Tensor, weights_Tk: torch.Tensor, batch_shape: tuple[int, int],
                    num_experts: int, capacity: int, policy: str) -> torch.Tensor:
    """The `KeepMask` of one process: every token of the micro-batch is here."""
    return capacity_keep_mask(indices_Tk, weights_Tk, num_experts, capacity, policy)
