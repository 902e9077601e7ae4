"""Routed experts as one grouped GEMM (MegaBlocks, Gale et al. 2022: no padding, no dropping).

The tokens arrive sorted by expert, `tokens_per_expert[e]` rows each; rows after the last
expert's (slots dropped by a capacity, kept in place so shapes stay fixed) belong to no expert.
`torch._grouped_mm` never writes those rows, in its output or in its input's gradient: they hold
whatever the memory held, maybe NaN, and the dispatcher masks them (`where`, before anything
multiplies them) on the way in and on the way out.
`torch._grouped_mm` runs all experts' matrix products in one call when its layout rules hold
(int32 offsets; every row stride a multiple of 16 bytes); otherwise an equivalent loop over
experts does the same arithmetic.
Weights are stored [E, out, in] like nn.Linear. N rows, D model dim, F expert hidden dim.

The weight a forward computes with is a seam (`GroupedExperts.local_weight`, a `LocalWeight`): on
one process the stored parameter itself; under expert / expert-tensor parallelism the parameters
are DTensors and `tessera.parallel` installs an accessor that returns this rank's shard (its
experts, its slice of F), so the same forward runs on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# A stored expert weight -> the tensor this process multiplies with.
LocalWeight = Callable[[torch.Tensor], torch.Tensor]


def stored_weight(w: torch.Tensor) -> torch.Tensor:
    """The `LocalWeight` of one process: all experts' whole weights are here."""
    return w


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm`'s backward
    refuses expanded (stride-0) gradients such as the one `y.sum()` produces.

    The output shares the input's storage without being an autograd view (`detach`, not
    `view_as`): it is the experts' output, and FSDP2 warns that an in-place op on a view returned
    by a wrapped module would skip its pre-backward all-gather. Nothing else reads the input."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm_applies(x_ND: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x_ND.dtype != w_EOI.dtype:
        return False
    size = x_ND.element_size()
    return x_ND.shape[-1] * size % 16 == 0 and w_EOI.shape[1] * size % 16 == 0


def grouped_linear(x_ND: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert: torch.Tensor,
                   use_grouped_mm: bool = True) -> torch.Tensor:
    """Row block e of x times w[e]^T: [N, I] -> [N, O]. Under autocast both run in the autocast
    dtype, as nn.Linear would (autocast does not cover `_grouped_mm` itself)."""
    device = x_ND.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x_ND, w_EOI = x_ND.to(dtype), w_EOI.to(dtype)
    if use_grouped_mm and grouped_mm_applies(x_ND, w_EOI):
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        return _DenseGrad.apply(torch._grouped_mm(x_ND, w_EOI.transpose(1, 2), offs=offs))
    # The fallback loop needs the row counts on the host; the grouped GEMM above does not.
    sizes = tokens_per_expert.tolist()
    tail = x_ND.shape[0] - sum(sizes)  # rows after the last expert's (dropped slots): zeros
    chunks = torch.split(x_ND, [*sizes, tail])
    out = [c @ w_EOI[e].T for e, c in enumerate(chunks[:-1])]
    return torch.cat([*out, x_ND.new_zeros(tail, w_EOI.shape[1])], dim=0)


def each_expert_on_its_rows(expert: Callable[[int, torch.Tensor], torch.Tensor], x_ND: torch.Tensor,
                            tokens_per_expert: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows sorted by expert through `expert(e, rows)` one expert at a time (the kept-quantized experts'
    loop: only the experts that got rows run); the rows past the counts (capacity's dropped ones) are
    zero. [N, D] -> [N, dim]."""
    sizes = tokens_per_expert.tolist()
    tail = x_ND.shape[0] - sum(sizes)
    chunks = torch.split(x_ND, [*sizes, tail])
    out = [expert(e, c) if c.shape[0] else c for e, c in enumerate(chunks[:-1])]
    return torch.cat([*out, x_ND.new_zeros(tail, dim)], dim=0)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w2(silu(w1 x) * w3 x), each on its own contiguous block of rows."""

    # each weight's hidden dim F, which expert tensor parallelism cuts (the experts' dim 0 is ep's)
    split_dims = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, use_grouped_mm: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # down
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # up
        self.use_grouped_mm = use_grouped_mm
        self.local_weight: LocalWeight = stored_weight

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (self.local_weight(w) for w in (self.w1, self.w2, self.w3))
        g = self.use_grouped_mm
        h = F.silu(grouped_linear(x_ND, w1, tokens_per_expert, g)) * grouped_linear(x_ND, w3, tokens_per_expert, g)
        return grouped_linear(h, w2, tokens_per_expert, g)


class Relu2Experts(nn.Module):
    """E ungated experts: w2(relu(w1 x)^2), each on its own contiguous block of rows (Nemotron-H's MoE)."""

    split_dims = {"w1": 1, "w2": 2}

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, use_grouped_mm: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # down
        self.use_grouped_mm = use_grouped_mm
        self.local_weight: LocalWeight = stored_weight

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2 = (self.local_weight(w) for w in (self.w1, self.w2))
        g = self.use_grouped_mm
        return grouped_linear(F.relu(grouped_linear(x_ND, w1, tokens_per_expert, g)).square(), w2, tokens_per_expert, g)
