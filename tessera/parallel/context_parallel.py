"""Context parallelism (CP): every sequence of a micro-batch is split over the cp ranks for the whole
model, and only attention and the recurrent mixers' state handoff communicate (everything else works
token by token); it still computes
exactly the causal attention of the whole sequence. `parallel.cp_method` chooses the attention
core and, with it, the split (sequence_layout.py): "alltoall" keeps cp contiguous chunks (rank r
holds chunk r), "allgather" and "ring" the balanced zig-zag split (rank r holds chunks r and
2 cp - 1 - r of 2 cp), under which every rank has the same causal work.

The model declares every seam this file uses, and this file only installs implementations of
them (no subclassing, no hooks): each attention module's `attention_core`, the model's
`position_source` and, with expert capacity, each MoE layer's `keep_mask`.

Attention cores (installed as each attention module's `attention_core`; all exact, under autograd):

- "alltoall" (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509, section 3): an all-to-all
  turns q, k, v from [B, heads, S/cp, D] (all local heads, this rank's chunk) into
  [B, heads/cp, S, D] (1/cp of the heads, the whole sequence), the single-device
  `causal_attention` runs on them (so sliding windows and MLA's head dims come for free), and a
  second all-to-all brings the output back to [B, heads, S/cp, D]. The backward of an all-to-all
  is the reverse all-to-all. GQA: each rank takes the kv heads of its query heads; when cp does
  not divide the kv heads, they are first repeated (each r times, the smallest r that makes cp
  divide them), and the repeat's backward sums their gradients. Every rank computes the same
  work whatever the chunk, so the contiguous split is load-balanced. Where cp does not divide
  this rank's query heads (H / tp) it falls back to the all-gather core over the same
  contiguous chunks (exact; the last rank then does the most causal work).
- "allgather" (the all-gather variant of Llama 3, Dubey et al. 2024, section 3.3.2): k and v
  are gathered along the sequence (backward: reduce-scatter of their gradients), and this rank's
  queries attend to them under the causal (and sliding-window) mask at their global positions.
  Any head count.
- "ring" (ring_attention.py): k/v blocks travel the cp ring, each transfer issued before the
  previous block's compute, partial results merged by their log-sum-exp. Any head count; one
  block of k/v in flight instead of the whole sequence.

Positions: the model's `position_source` becomes `ChunkPositions`, the global positions of this
rank's tokens under the split (a caller that passes `positions` keeps them), so RoPE rotates every
token as one device would.

Multi-token prediction (models/mtp.py): the model's `mtp_sequence` becomes `ChunkTokens`, which
all-gathers the cp ranks' token ids (integers: exact, no gradient) into sequence order, so that each
depth's shift reaches tokens held by another rank, and keeps this rank's positions of the result.

Sparse attention (DeepSeek-V3.2, models/attention_variants/sparse_mla.py) runs its own core: its `sequence`
seam becomes `GatheredKeys`, the all-gather of every rank's keys, values and indexer keys in sequence
order, so each rank's queries take their top-k over all the keys of the sequence (any cp_method).

Recurrent mixers (Gated DeltaNet, Kimi delta attention, Mamba-2): each rank runs them over its own
tokens only, from the state the previous part of the sequence hands on (context_parallel_recurrent.py).

MoE: the router's token counts (and its per-sequence counts and Sinkhorn sums) are summed over cp
(`MicroBatchCountReducer`, expert_parallel.py); with expert capacity the keep-or-drop decision is
taken over the whole micro-batch in sequence order (`MicroBatchKeepMask`, context_parallel_moe.py).
Shapes: B batch, H query heads, G kv heads, S sequence, C = S/cp chunk, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tessera.config.errors import ParallelError
from tessera.config.parallel import CP_METHODS
from tessera.models.attention import Attention, Window, causal_attention, sliding_window_mask
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.moe.layer import MoE
from tessera.models.mtp import TokenSequence
from tessera.parallel.collectives import all_to_all_rows, gather_rows
from tessera.parallel.context_parallel_moe import MicroBatchKeepMask, MicroBatchTokenReducer
from tessera.parallel.context_parallel_recurrent import PartHandoff
from tessera.parallel.dims import ParallelDims
from tessera.parallel.ring_attention import RingAttention
from tessera.parallel.sequence_layout import (
    CP_LAYOUTS,
    all_rank_positions,
    rank_positions,
    take_rank_tokens,
    to_sequence_order,
)


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
                       window: Window, group: ProcessGroup) -> torch.Tensor:
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
                        window: Window, group: ProcessGroup, layout: str = "contiguous") -> torch.Tensor:
    """Exact causal attention of this rank's queries over the gathered keys/values; [B, H, C, Dv].
    The mask takes every token's global position under `layout` (sequence_layout.py)."""
    C, device = q_BHCD.shape[2], q_BHCD.device
    k, v = gather_sequence(k_BGCD, group), gather_sequence(v_BGCD, group)
    positions = all_rank_positions(C, dist.get_world_size(group), layout, device)  # [cp, C]
    mask = sliding_window_mask(positions[dist.get_rank(group)], positions.flatten(), window)
    return F.scaled_dot_product_attention(q_BHCD, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q_BHCD.shape[1] != k.shape[1])


class ContextParallelAttention:
    """An attention module's `attention_core` under cp. `method` (`parallel.cp_method`): "alltoall"
    where cp divides the local query heads, else "allgather" over the same chunks (None: the same
    automatic choice); "allgather" and "ring" for any head count. `layout` is how the sequence is
    split (sequence_layout.py); the all-to-all core needs "contiguous". A plain callable, not a
    module, so parameter names and state dicts do not change."""

    def __init__(self, group: ProcessGroup, method: str | None = None, layout: str = "contiguous"):
        if method is not None and method not in CP_METHODS:
            raise ParallelError(f"parallel.cp_method={method!r} is invalid: one of {', '.join(CP_METHODS)}")
        if layout not in CP_LAYOUTS:
            raise ParallelError(f"context-parallel layout {layout!r} is invalid: one of {', '.join(CP_LAYOUTS)}")
        self.group, self.method, self.layout = group, method, layout
        self.cp = dist.get_world_size(group)
        self.ring = RingAttention(group, layout)

    def method_for(self, q_heads: int) -> str:
        if self.method in ("allgather", "ring"):
            return self.method
        return "alltoall" if q_heads % self.cp == 0 and self.layout == "contiguous" else "allgather"

    def __call__(self, q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, v_BGCD: torch.Tensor, scale: float,
                 window: Window = None) -> torch.Tensor:
        method = self.method_for(q_BHCD.shape[1])
        if method == "alltoall":
            return alltoall_attention(q_BHCD, k_BGCD, v_BGCD, scale, window, self.group)
        if method == "ring":
            return self.ring(q_BHCD, k_BGCD, v_BGCD, scale, window)
        return allgather_attention(q_BHCD, k_BGCD, v_BGCD, scale, window, self.group, self.layout)


class GatheredKeys:
    """Sparse attention's `sequence` seam under cp (models/attention_variants/sparse_mla.py): every cp rank's
    keys, values and indexer keys all-gathered (backward: reduce-scatter of their gradients) and put in
    sequence order, with the keys each of this rank's queries may see at its global positions, so that
    the indexer scores all the keys of the sequence and picks as one process does (its ties go to the
    earlier key, which needs sequence order)."""

    def __init__(self, group: ProcessGroup, cp_rank: int, cp: int, layout: str = "contiguous"):
        self.group, self.cp_rank, self.cp, self.layout = group, cp_rank, cp, layout

    def __call__(self, k_BHCD: torch.Tensor, v_BHCD: torch.Tensor, index_keys_BCD: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, _, C, _ = k_BHCD.shape
        positions = all_rank_positions(C, self.cp, self.layout, k_BHCD.device)  # [cp, C]
        order = positions.flatten().argsort()  # gathered (rank) order -> sequence order
        k, v = (gather_sequence(t, self.group).index_select(2, order) for t in (k_BHCD, v_BHCD))
        keys = gather_rows(index_keys_BCD.transpose(0, 1).contiguous(), self.group).index_select(0, order)
        allowed = positions[self.cp_rank][:, None] >= torch.arange(self.cp * C, device=k_BHCD.device)[None, :]
        return k, v, keys.transpose(0, 1), allowed.expand(B, C, self.cp * C)


class ChunkPositions:
    """The model's `position_source` under cp: this rank's C tokens of every sequence sit at their
    global positions under `layout` (RoPE must rotate by where a token is in the sequence):
    [r C, (r+1) C) for the contiguous split, chunks r and 2 cp - 1 - r of 2 cp for the zig-zag one."""

    def __init__(self, cp_rank: int, cp: int = 1, layout: str = "contiguous"):
        self.cp_rank, self.cp, self.layout = cp_rank, cp, layout

    def __call__(self, B: int, C: int, device: torch.device) -> torch.Tensor:
        return rank_positions(C, self.cp, self.cp_rank, self.layout, device).expand(B, C)

    def sequence_length(self, C: int) -> int:
        """The whole sequence's length when this rank holds C of its tokens (LongRoPE's table choice)."""
        return C * self.cp


class ChunkTokens(TokenSequence):
    """The model's `mtp_sequence` under cp: token ids [B, C] of this rank become the whole [B, S] in
    sequence order (an all-gather over cp), and a whole-sequence tensor this rank's [B, C] under
    `layout`, so that multi-token prediction's shift by k reaches tokens on other ranks."""

    def __init__(self, group: ProcessGroup, cp_rank: int, cp: int, layout: str = "contiguous"):
        self.group, self.cp_rank, self.cp, self.layout = group, cp_rank, cp, layout

    def whole(self, t_BC: torch.Tensor) -> torch.Tensor:
        every = t_BC.new_empty((self.cp * t_BC.shape[0],) + tuple(t_BC.shape[1:]))  # [P B, C]: rank by rank
        dist.all_gather_into_tensor(every, t_BC.contiguous(), group=self.group)
        return to_sequence_order(every.view((self.cp,) + tuple(t_BC.shape)), self.layout)

    def own(self, t_BS: torch.Tensor) -> torch.Tensor:
        return take_rank_tokens(t_BS, self.cp, self.cp_rank, self.layout)


def apply_context_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """Install the cp attention core (`dims.cp_method`) in every attention module (sparse attention: the
    all-gather of its keys, `GatheredKeys`), the positions of
    this rank's tokens (`dims.cp_layout`) and multi-token prediction's token exchange on the model,
    the state handoff in every recurrent mixer (context_parallel_recurrent.py) and, in MoE layers,
    Sinkhorn's micro-batch-wide sums and (with expert capacity) micro-batch-wide
    token dropping. No-op for cp = 1."""
    if dims.cp == 1:
        return
    group = dims["cp"].get_group()
    rank = dims.local_rank("cp")
    core = ContextParallelAttention(group, dims.cp_method, dims.cp_layout)
    for module in model.modules():
        if isinstance(module, (Attention, MultiHeadLatentAttention)):
            module.attention_core = core
        if isinstance(module, SparseLatentAttention):  # its own core: top-k over every key of the sequence
            module.sequence = GatheredKeys(group, rank, dims.cp, dims.cp_layout)
        elif isinstance(module, (GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer)):
            module.handoff = PartHandoff(group, rank, dims.cp, dims.cp_layout)
        elif isinstance(module, MoE):
            module.router.reduce_over_tokens = MicroBatchTokenReducer(group)
            if module.cfg.capacity_factor is not None:
                module.keep_mask = MicroBatchKeepMask(group, rank, dims.cp, dims.cp_layout)
    model.position_source = ChunkPositions(rank, dims.cp, dims.cp_layout)
    model.mtp_sequence = ChunkTokens(group, rank, dims.cp, dims.cp_layout)
