"""Which tokens of every sequence a context-parallel rank holds: the one definition that the batch
sharding, the RoPE positions, the attention masks and the MoE keep-or-drop decision all follow.

Two layouts of a sequence of S tokens over cp ranks, each rank holding C = S / cp of them:

- "contiguous": rank r holds chunk r of cp, positions [r C, (r+1) C). Under a causal mask the
  last rank's queries see the whole sequence and the first rank's only its own chunk, so the
  gather- and ring-based attentions would be unbalanced (the all-to-all one is not).
- "zigzag" (head-tail; Brandon et al. 2023, "Striped Attention", and the load-balanced ring of
  Megatron-Core / torchtitan): the sequence is cut into 2 cp chunks of c = S / (2 cp) and rank r
  holds chunks r and 2 cp - 1 - r, in that order. Every rank then has one early and one late
  chunk and the same number of causal (query, key) pairs.

Shapes: S sequence, C = S / cp tokens per rank, P = cp ranks.
"""

from __future__ import annotations

import torch

from tessera.config.errors import ParallelError

CP_LAYOUTS = ("contiguous", "zigzag")


def rank_positions(C: int, cp: int, cp_rank: int, layout: str, device: torch.device | None = None) -> torch.Tensor:
    """Global positions [C] of the tokens cp rank `cp_rank` holds, in the order it holds them."""
    if layout == "contiguous":
        return torch.arange(cp_rank * C, (cp_rank + 1) * C, device=device)
    if layout != "zigzag":
        raise ParallelError(f"context-parallel layout {layout!r} is invalid: one of {', '.join(CP_LAYOUTS)}")
    if C % 2:
        raise ParallelError(f"the zig-zag split needs an even number of tokens per cp rank, got {C}")
    c = C // 2
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([head, tail])


def all_rank_positions(C: int, cp: int, layout: str, device: torch.device | None = None) -> torch.Tensor:
    """[P, C]: row r is `rank_positions` of rank r (row-major, it is also the order of an all-gather)."""
    return torch.stack([rank_positions(C, cp, r, layout, device) for r in range(cp)])


def take_rank_tokens(x: torch.Tensor, cp: int, cp_rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along the sequence dimension `dim` (length S), in its order."""
    S = x.shape[dim]
    parts = cp if layout == "contiguous" else 2 * cp
    if S % parts:
        raise ParallelError(f"cp={cp} with the {layout} split cuts every sequence into {parts} chunks, which does "
                            f"not divide the sequence length {S}; choose a train.seq_len that {parts} divides")
    if layout == "contiguous":
        return x.narrow(dim, cp_rank * (S // cp), S // cp)
    return x.index_select(dim, rank_positions(S // cp, cp, cp_rank, layout, x.device))


def to_sequence_order(x_PBCk: torch.Tensor, layout: str) -> torch.Tensor:
    """Every rank's tokens [P, B, C, ...] (as all-gathered) -> [B, S, ...] in sequence order."""
    P, B, C = x_PBCk.shape[:3]
    rest = tuple(x_PBCk.shape[3:])
    rows = x_PBCk.transpose(0, 1).reshape((B, P * C) + rest)
    if layout == "contiguous":
        return rows
    out = torch.empty_like(rows)
    out[:, all_rank_positions(C, P, layout, x_PBCk.device).flatten()] = rows
    return out
