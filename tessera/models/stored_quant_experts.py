"""Routed experts that keep a pre-quantized checkpoint's weights as the checkpoint stores them.

A checkpoint stores each routed expert's three projections as separate quantized linear layers
(`experts.{j}.gate_proj` / `down_proj` / `up_proj`, or Mixtral's `w1` / `w2` / `w3`): DeepSeek-V3's
block FP8 (`weight` e4m3, `weight_scale_inv` per 128 x 128 block), or any compressed-tensors scheme
(pack-quantized W4A16 / W8A16, int-quantized W8A8, float-quantized FP8). `StoredQuantExperts`
holds, for each of w1 (gate), w2 (down) and w3 (up), one `StoredQuantLinear` per expert
(tessera/models/stored_quant.py), whose buffers are the stored tensors themselves, so the codes
stay in their stored precision in memory and each expert's own activation scheme (its static
`input_scale`, or a dynamic one) applies to the rows routed to it.

The forward takes the rows sorted by expert as `GroupedExperts` does (tokens_per_expert[e] rows
each, then rows that belong to no expert, which come out zero) and computes each expert that got
rows as w2(silu(w1 x) * w3 x) by the plain PyTorch reference: the expert's weights dequantized to
the activations' dtype, then F.linear. Only one expert's weights are dequantized at a time, and
an expert no row was routed to is never dequantized.

The weights are not parameters (nothing trains them), so expert parallelism, which splits
parameters, refuses these experts by name (tessera/parallel/expert_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.stored_quant import StoredQuantLinear

PROJECTIONS = ("w1", "w2", "w3")  # gate, down, up (GroupedExperts' names)
Factory = Callable[..., StoredQuantLinear]  # (in_features, out_features, bias, dtype) -> layer


class StoredQuantExperts(nn.Module):
    """E SwiGLU experts whose projections are checkpoint-quantized linear layers (module docstring)."""

    quantized = True  # not quantizable again (tessera/models/int8.py quantizable_layers)

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, dtype: torch.dtype,
                 factories: dict[str, Sequence[Factory]]):
        """`factories[p][e]` builds expert e's projection p (one per expert: the checkpoint may give
        experts different layouts, e.g. activation ordering on some)."""
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        shapes = {"w1": (dim, hidden_dim), "w2": (hidden_dim, dim), "w3": (dim, hidden_dim)}  # (in, out)
        for p in PROJECTIONS:
            layers = [factories[p][e](*shapes[p], False, dtype) for e in range(num_experts)]
            setattr(self, p, nn.ModuleList(layers))

    def expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows: [n, D] -> [n, D]."""
        return self.w2[e](F.silu(self.w1[e](x_ND)) * self.w3[e](x_ND))

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        sizes = tokens_per_expert.tolist()
        tail = x_ND.shape[0] - sum(sizes)  # rows after the last expert's (dropped slots): zeros
        chunks = torch.split(x_ND, [*sizes, tail])
        out = [self.expert(e, c) if c.shape[0] else c for e, c in enumerate(chunks[:-1])]
        return torch.cat([*out, x_ND.new_zeros(tail, self.dim)], dim=0)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"
