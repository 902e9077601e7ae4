"""Routed experts with biases and the clamped SwiGLU (gpt-oss), stored as HuggingFace stores them.

    h = x W_gu[e] + b_gu[e]                  W_gu [E, D, 2F]: gate and up interleaved by column
    g = min(h[:, 0::2], limit),  u = clamp(h[:, 1::2], -limit, limit)
    y = ((u + 1) * g * sigmoid(alpha g)) W_d[e] + b_d[e]      W_d [E, F, D]

The tensors keep HuggingFace's names, shapes and interleaving (`gate_up_proj`, `gate_up_proj_bias`,
`down_proj`, `down_proj_bias`), so loading and saving copy them as they are. The products run as
`GroupedExperts`' do (experts.py: one grouped GEMM, rows sorted by expert; rows past the last
expert's belong to none and get no bias), through the same `local_weight` seam, so expert
parallelism cuts these tensors by expert as it cuts those (`split_dims`). Their hidden dimension is
not cut over tp (a bias on the down projection would be added once per rank): under tensor
parallelism every rank computes its tokens' experts whole. N rows, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.moe.experts import LocalWeight, grouped_linear, stored_weight


def clamped_swiglu(h_N2F: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of the interleaved gate/up product."""
    gate, up = h_N2F[:, 0::2].clamp(max=limit), h_N2F[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _row_bias(bias_EO: torch.Tensor, tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert's bias [rows, O]; zero for the rows past the last expert's."""
    per_row = bias_EO.repeat_interleave(tokens_per_expert.to(torch.long), dim=0)
    tail = rows - per_row.shape[0]
    return torch.cat([per_row, per_row.new_zeros(tail, bias_EO.shape[1])]) if tail else per_row


class BiasedExperts(nn.Module):
    # expert parallelism: each tensor's expert dim (all 0); None: no hidden dim cut over tp (docstring)
    split_dims = {"gate_up_proj": None, "gate_up_proj_bias": None, "down_proj": None, "down_proj_bias": None}

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float,
                 use_grouped_mm: bool = True):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.alpha, self.limit, self.use_grouped_mm = alpha, limit, use_grouped_mm
        self.local_weight: LocalWeight = stored_weight

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w_gu, b_gu, w_d, b_d = (self.local_weight(w) for w in (self.gate_up_proj, self.gate_up_proj_bias,
                                                               self.down_proj, self.down_proj_bias))
        N, g = x_ND.shape[0], self.use_grouped_mm
        h = grouped_linear(x_ND, w_gu.transpose(1, 2), tokens_per_expert, g)
        h = h + _row_bias(b_gu, tokens_per_expert, N).to(h.dtype)
        y = grouped_linear(clamped_swiglu(h, self.alpha, self.limit), w_d.transpose(1, 2), tokens_per_expert, g)
        return y + _row_bias(b_d, tokens_per_expert, N).to(y.dtype)
