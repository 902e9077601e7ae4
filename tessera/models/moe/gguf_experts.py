"""Routed SwiGLU experts kept in a GGUF file's block types for serving (`GgufExperts`): the gate, up
and down matrices as the file stores them (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` in Q4_K,
Q8_0, Q4_0 ..., each projection in its own type), so the experts take the file's bytes in memory
instead of 4 bytes per weight.

    w1.blocks [E, F, row bytes of D] (gate), w3.blocks [E, F, row bytes of D] (up),
    w2.blocks [E, D, row bytes of F] (down): uint8, one `ExpertBlocks` each

The forward computes what `GroupedExperts` computes, w2(silu(w1 x) * w3 x), one expert at a time on
its own rows (sorted by expert, as the dispatcher hands them over) and only for the experts some row
was routed to; rows past the last expert's come out zero. By itself a projection dequantizes the one
expert's blocks (`tessera.models.gguf_blocks`, the values a load that dequantizes gives, bit for
bit) and multiplies with F.linear: the reference, which autograd and every device use. A model the
engine serves on CPU in fp32 multiplies by the blocks instead: the engine installs the block kernel
at `ExpertBlocks.fused` (tessera.infer.cpu.gguf_matmul, GgufLinear's kernel), which takes an
expert's rows without autograd up to a short chunk's count and leaves the rest to the reference's
arithmetic. The blocks are buffers (nothing trains them): expert parallelism refuses these experts as
it refuses every `quantized` one; tensor-parallel serving dequantizes them (`dequantized`).
N rows, D model dim, F expert hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.gguf_blocks import BLOCKS, dequantize, row_bytes
from tessera.models.moe.experts import GroupedExperts, each_expert_on_its_rows

PROJECTIONS = ("w1", "w2", "w3")  # gate, down, up: GroupedExperts' names


class ExpertBlocks(nn.Module):
    """One projection of E experts, [E, out_features, in_features] logically, held as GGML `kind`
    blocks (the buffer `blocks` [E, out_features, row bytes])."""

    # (projection, expert, x) -> y, or None to take the reference; set by tessera.infer.cpu.gguf_matmul
    fused: Callable[[nn.Module, int, torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, kind: str, num_experts: int, in_features: int, out_features: int,
                 device: torch.device | str | None = None):
        super().__init__()
        if kind not in BLOCKS:
            raise ValueError(f"GGML type {kind!r} has no torch dequantizer; supported: {', '.join(BLOCKS)}")
        self.kind, self.num_experts, self.in_features, self.out_features = kind, num_experts, in_features, out_features
        self.register_buffer("blocks", torch.zeros(num_experts, out_features, row_bytes(kind, in_features),
                                                   dtype=torch.uint8, device=device))

    def weight(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix dequantized [out_features, in_features]."""
        return dequantize(self.kind, self.blocks[e], (self.out_features, self.in_features)).to(dtype)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused(self, e, x)
            if y is not None:
                return y
        return F.linear(x, self.weight(e, x.dtype))

    def extra_repr(self) -> str:
        return f"{self.kind}, num_experts={self.num_experts}, in_features={self.in_features}, " \
               f"out_features={self.out_features}"


class GgufExperts(nn.Module):
    """E SwiGLU experts w2(silu(w1 x) * w3 x) whose matrices are GGML blocks of `kinds` (projection ->
    type: each of w1, w2, w3)."""

    quantized = True  # not quantizable again, not cut by expert parallelism

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, kinds: dict[str, str],
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.w1 = ExpertBlocks(kinds["w1"], num_experts, dim, hidden_dim, device)
        self.w2 = ExpertBlocks(kinds["w2"], num_experts, hidden_dim, dim, device)
        self.w3 = ExpertBlocks(kinds["w3"], num_experts, dim, hidden_dim, device)

    def expert(self, e: int, x_nD: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows: [n, D] -> [n, D]."""
        return self.w2(e, F.silu(self.w1(e, x_nD)) * self.w3(e, x_nD))

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return each_expert_on_its_rows(self.expert, x_ND, tokens_per_expert, self.dim)

    def dequantized(self, dtype: torch.dtype, use_grouped_mm: bool = True) -> GroupedExperts:
        """The same experts as a `GroupedExperts` of float `dtype` weights (every expert dequantized)."""
        dense = GroupedExperts(self.num_experts, self.dim, self.hidden_dim, use_grouped_mm)
        for name in PROJECTIONS:
            blocks: ExpertBlocks = getattr(self, name)
            weight = torch.stack([blocks.weight(e, dtype) for e in range(self.num_experts)])
            setattr(dense, name, nn.Parameter(weight))
        return dense

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"
