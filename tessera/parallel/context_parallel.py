"""Context parallelism (CP): every sequence of a micro-batch is cut into cp contiguous chunks and
cp rank r holds chunk r, tokens [r S/cp, (r+1) S/cp), for the whole model. Everything but
attention works token by token, so only attention communicates; it still computes exactly the
causal attention of the whole sequence.

The model declares every seam this file uses, and this file only installs implementations of
them (no subclassing, no hooks): each attention module's `attention_core`, the model's
`position_source` and, with expert capacity, each MoE layer's `keep_mask`.

Attention cores (installed as each attention module's `attention_core`; both exact, under autograd):

- "alltoall" (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509, section 3): an all-to-all
  turns q, k, v from [B, heads, S/cp, D] (all local heads, this rank's chunk) into
  [B, heads/cp, S, D] (1/cp of the heads, the whole sequence), the single-device
  `causal_attention` runs on them (so sliding windows and MLA's head dims come for free), and a
  second all-to-all brings the output back to [B, heads, S/cp, D]. The backward of an all-to-all
  is the reverse all-to-all. GQA: each rank takes the kv heads of its query heads; when cp does
  not divide the kv heads, they are first repeated (each r times, the smallest r that makes cp
  divide them), and the repeat's backward sums their gradients. Every rank computes the same
  work whatever the chunk, so the contiguous split is load-balanced (no zig-zag needed).
  Used when cp divides this rank's query heads (H / tp).
- "allgather" (the all-gather variant of Llama 3, Dubey et al. 2024, section 3.3.2): k and v
  are gathered along the sequence (backward: reduce-scatter of their gradients), and this rank's
  queries attend to them under the causal (and sliding-window) mask at their global positions.
  Any head count; used when cp does not divide H / tp. With contiguous chunks the causal work
  is unbalanced (rank cp-1 does the most); the result is exact.

Positions: the model's `position_source` becomes `ChunkPositions`, the global positions of this
rank's chunk (a caller that passes `positions` keeps them), so RoPE rotates every token as one
device would.

MoE: the router's token counts are summed over cp (`MicroBatchCountReducer`, expert_parallel.py);
with expert capacity the keep-or-drop decision is taken over the whole micro-batch
(`MicroBatchKeepMask`, context_parallel_moe.py). The sequence-level balancing loss and Sinkhorn
routing need every token of a sequence in one place and are refused with cp > 1
(`ParallelDims.validate`).
Shapes: B batch, H query heads, G kv heads, S sequence, C = S/cp chunk, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tessera.config.errors import ParallelError
from tessera.models.attention import Attention, causal_attention, sliding_window_mask
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.moe.layer import MoE
from tessera.parallel.collectives import all_to_all_rows, gather_rows
from tessera.parallel.context_parallel_moe import MicroBatchKeepMask
from tessera.parallel.dims import ParallelDims

CP_ATTENTION = ("alltoall", "allgather")


def _exchange_blocks(x_P: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """x [cp, ...]: block j goes to rank j; returns [cp, ...] whose block i came from rank i."""
    cp = x_P.shape[0]
    flat = x_P.reshape(cp, -1)
    return all_to_all_rows(flat, [1] * cp, [1] * cp, group).view(x_P.shape)


def heads_to_sequence(x_BHCD: torch.Tensor, cp: int, group: ProcessGroup) -> torch.Tensor:
    """[B, H, C, D] (every head, this rank's chunk) -> [B, H/cp, S, D] (head block r, whole sequence)."""
    B, H, C, D = x_BHCD.shape
    blocks = x_BHCD.reshape(B, cp, H // cp, C, D).transpose(0, 1)  # [cp, B, H/cp, C, D]: head block j
    chunks = _exchange_blocks(blocks.contiguous(), group)  # [cp, B, H/cp, C, D]: chunk i of my heads
    return chunks.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * C, D)


def sequence_to_heads(x_BhSD: torch.Tensor, cp: int, group: ProcessGroup) -> torch.Tensor:
    """[B, H/cp, S, D] -> [B, H, C, D]: the inverse of `heads_to_sequence`."""
    B, h, S, D = x_BhSD.shape
    chunks = x_BhSD.reshape(B, h, cp, S // cp, D).permute(2, 0, 1, 3, 4)  # [cp, B, h, C, D]: chunk j
    blocks = _exchange_blocks(chunks.contiguous(), group)  # [cp, B, h, C, D]: my chunk of head block i
    return blocks.transpose(0, 1).reshape(B, cp * h, S // cp, D)


def kv_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How often each kv head is repeated so that cp divides the kv heads and each rank's query
    heads find theirs: the smallest r dividing q_heads / kv_heads with cp | kv_heads * r."""
    group = q_heads // kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (kv_heads * r) % cp == 0:
            return r
    raise ParallelError(f"cp={cp} does not divide the {q_heads} local query heads; the all-to-all "
                        "attention needs it (the all-gather attention does not)")


def alltoall_attention(q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, v_BGCD: torch.Tensor, scale: float,
                       window: int | None, group: ProcessGroup) -> torch.Tensor:
    """Exact causal attention of the whole sequence from this rank's chunk (Ulysses); [B, H, C, Dv]."""
    cp = dist.get_world_size(group)
    r = kv_repeats(q_BHCD.shape[1], k_BGCD.shape[1], cp)
    if r > 1:
        k_BGCD, v_BGCD = (t.repeat_interleave(r, dim=1) for t in (k_BGCD, v_BGCD))
    q, k, v = (heads_to_sequence(t, cp, group) for t in (q_BHCD, k_BGCD, v_BGCD))
    return sequence_to_heads(causal_attention(q, k, v, scale, window), cp, group)


def gather_sequence(x_BGCD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[B, G, C, D] on every rank -> [B, G, S, D] in rank (= sequence) order; backward reduce-scatters."""
    B, G, C, D = x_BGCD.shape
    whole = gather_rows(x_BGCD.permute(2, 0, 1, 3).contiguous(), group)  # [S, B, G, D]
    return whole.permute(1, 2, 0, 3)


def allgather_attention(q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, v_BGCD: torch.Tensor, scale: float,
                        window: int | None, group: ProcessGroup) -> torch.Tensor:
    """Exact causal attention of this rank's queries over the gathered keys/values; [B, H, C, Dv]."""
    C = q_BHCD.shape[2]
    k, v = gather_sequence(k_BGCD, group), gather_sequence(v_BGCD, group)
    q_pos = dist.get_rank(group) * C + torch.arange(C, device=q_BHCD.device)
    mask = sliding_window_mask(q_pos, torch.arange(k.shape[2], device=q_BHCD.device), window)
    return F.scaled_dot_product_attention(q_BHCD, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q_BHCD.shape[1] != k.shape[1])


class ContextParallelAttention:
    """An attention module's `attention_core` under cp: "alltoall" where cp divides the local
    query heads, else "allgather" (`method` forces one). A plain callable, not a module, so
    parameter names and state dicts do not change."""

    def __init__(self, group: ProcessGroup, method: str | None = None):
        if method is not None and method not in CP_ATTENTION:
            raise ParallelError(f"context-parallel attention {method!r} is invalid: one of {', '.join(CP_ATTENTION)}")
        self.group, self.method = group, method
        self.cp = dist.get_world_size(group)

    def method_for(self, q_heads: int) -> str:
        return self.method or ("alltoall" if q_heads % self.cp == 0 else "allgather")

    def __call__(self, q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, v_BGCD: torch.Tensor, scale: float,
                 window: int | None = None) -> torch.Tensor:
        if self.method_for(q_BHCD.shape[1]) == "alltoall":
            return alltoall_attention(q_BHCD, k_BGCD, v_BGCD, scale, window, self.group)
        return allgather_attention(q_BHCD, k_BGCD, v_BGCD, scale, window, self.group)


class ChunkPositions:
    """The model's `position_source` under cp: this rank's chunk [B, C] sits at global positions
    [r C, (r+1) C) (RoPE must rotate by where a token is in the sequence)."""

    def __init__(self, cp_rank: int):
        self.cp_rank = cp_rank

    def __call__(self, B: int, C: int, device: torch.device) -> torch.Tensor:
        start = self.cp_rank * C
        return torch.arange(start, start + C, device=device).expand(B, C)


def apply_context_parallel(model: nn.Module, dims: ParallelDims, method: str | None = None) -> None:
    """Install the cp attention core in every attention module, the chunk positions on the model
    and, for MoE layers with expert capacity, micro-batch-wide token dropping. No-op for cp = 1."""
    if dims.cp == 1:
        return
    group = dims["cp"].get_group()
    rank = dims.local_rank("cp")
    core = ContextParallelAttention(group, method)
    for module in model.modules():
        if isinstance(module, (Attention, MultiHeadLatentAttention)):
            module.attention_core = core
        elif isinstance(module, MoE) and module.cfg.capacity_factor is not None:
            module.keep_mask = MicroBatchKeepMask(group, rank, dims.cp)
    model.position_source = ChunkPositions(rank)
