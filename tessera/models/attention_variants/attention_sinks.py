"""Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax
denominator and carries no value, so a head may attend to "nothing":

    out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))

`AttentionSinks` holds the logits (`weight` [H], HuggingFace's `self_attn.sinks`); under tensor
parallelism they are cut with the heads (`local()`: this rank's). `sink_attention` is attention
with them, as scaled dot-product attention with a mask: the scores are explicit (fp32 softmax),
which the training core, the serving engine's Python paths and its CPU rows all call where a layer
has sinks (the C++ paged-attention kernel takes none: such layers step aside from it).
Shapes: B batch, H query heads, G kv heads, S queries, L keys, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn


class AttentionSinks(nn.Module):
    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def local(self) -> torch.Tensor:
        """This rank's heads' sink logits (all of them on one process)."""
        w = self.weight
        return w.to_local() if hasattr(w, "to_local") else w


def sink_attention(q_BHSD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, scale: float,
                   sinks_H: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over [q k^T * scale + mask, sink_h] times [v, 0]: `mask` is boolean (True: visible)
    or additive, broadcast to [B, H, S, L], or None (every key visible)."""
    H, G = q_BHSD.shape[1], k_BGLD.shape[1]
    if H != G:
        k_BGLD = k_BGLD.repeat_interleave(H // G, dim=1)
        v_BGLD = v_BGLD.repeat_interleave(H // G, dim=1)
    scores = (q_BHSD.float() @ k_BGLD.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    sink = sinks_H.float().view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v_BGLD.float()).to(q_BHSD.dtype)
