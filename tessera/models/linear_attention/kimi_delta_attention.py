"""Kimi delta attention (KDA), the linear-attention token mixer of Kimi Linear's hybrid layers.

Gated DeltaNet (gated_deltanet.py) with a finer forget gate: each key channel of a head's state
decays at its own rate. Per token: q, k, v (H heads of K channels each, `q_proj`, `k_proj`,
`v_proj`) pass a short causal depthwise convolution with SiLU (`conv1d`, channels [q | k | v]);
the log-decay per channel is g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias) (a low-rank
projection through K, `f_a_proj` / `f_b_proj`), the write strength beta = sigmoid(b_proj(x)) per
head; then the gated delta rule with that per-channel decay (delta_rule.py, both forms). The
output is RMS-normed per head, gated by sigmoid(g_b(g_a(x))) (`o_norm`, another low-rank
projection) and projected back (`o_proj`).

The tensors keep HuggingFace's names and shapes (A_log is [1, 1, H, 1]). The recurrent state, the
cache protocols, the serving engine's packed step and the `handoff`, `fused_chunk_terms` and `kernels`
seams are Gated DeltaNet's (`DeltaNetState`: the convolution's last inputs over 3 H K channels, the
delta state [H, K, K]); so is `forward`. On CUDA `kernels` holds flash-linear-attention's `chunk_kda` /
`fused_recurrent_kda` where it imports (cuda_kernels.py). Prompts and training run the chunked form,
a single new token the recurrent one.
Under tensor parallelism each rank runs whole heads: q_proj, k_proj, v_proj, f_b_proj, g_b_proj and
b_proj cut by output rows, o_proj by input columns; the low-rank gates' first halves (f_a_proj,
g_a_proj) stay whole. The tensors all heads share a dimension of (the three convolutions as one
[q | k | v] tensor, dt_bias per channel, A_log per head, the norm's weight shared by all heads) are
read through `own_part` ("conv", "dt_bias", "A_log" flattened to [H], "norm"), as Gated DeltaNet's are.
Shapes: B batch, S sequence, D model dim, H heads, K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.cuda_kernels import RecurrentKernels, kernels_for
from tessera.models.linear_attention.delta_rule import ChunkTerms
from tessera.models.linear_attention.gated_deltanet import (
    DeltaNetState,
    GatedDeltaNet,
    OwnPart,
    conv_start,
    delta_rule,
    whole,
)
from tessera.models.linear_attention.handoff import StateHandoff, in_sequence_order
from tessera.models.norm import RMSNorm


def sigmoid_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) * sigmoid(gate), all in fp32 (as fla's gated norm), cast back at the end."""
    xf = x.float()
    normed = weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        la = cfg.linear_attention
        self.layer_id = layer_id
        self.heads, self.head_dim, self.chunk = la.n_key_heads, la.key_head_dim, la.chunk_size
        hk, K = la.n_key_heads * la.key_head_dim, la.key_head_dim
        self.q_proj = nn.Linear(cfg.dim, hk, bias=False)
        self.k_proj = nn.Linear(cfg.dim, hk, bias=False)
        self.v_proj = nn.Linear(cfg.dim, hk, bias=False)
        self.q_conv1d = nn.Conv1d(hk, hk, la.conv_width, groups=hk, bias=False)
        self.k_conv1d = nn.Conv1d(hk, hk, la.conv_width, groups=hk, bias=False)
        self.v_conv1d = nn.Conv1d(hk, hk, la.conv_width, groups=hk, bias=False)
        self.f_a_proj = nn.Linear(cfg.dim, K, bias=False)
        self.f_b_proj = nn.Linear(K, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hk))
        self.A_log = nn.Parameter(torch.zeros(1, 1, la.n_key_heads, 1))
        self.b_proj = nn.Linear(cfg.dim, la.n_key_heads, bias=False)
        self.g_a_proj = nn.Linear(cfg.dim, K, bias=False)
        self.g_b_proj = nn.Linear(K, hk, bias=False)
        self.o_norm = RMSNorm(K, cfg.norm_eps)
        self.o_proj = nn.Linear(hk, cfg.dim, bias=False)
        self.own_part: OwnPart = whole  # the seams (gated_deltanet.py's docstring)
        self.handoff: StateHandoff | None = None
        self.fused_chunk_terms: ChunkTerms | None = None
        self.kernels: RecurrentKernels | None = None  # chosen at the first call (cuda_kernels.py)

    forward = GatedDeltaNet.forward  # the same cache protocols and seams (module docstring)

    def mix(self, x_BSD: torch.Tensor, state: DeltaNetState | None = None, recurrent: bool | None = None
            ) -> tuple[torch.Tensor, DeltaNetState]:
        """(output [B, S, D], the state after the last token) from `state` (None: a sequence's
        start). `recurrent` picks the form: default token by token for one token, chunked otherwise."""
        B, S, _ = x_BSD.shape
        K = self.head_dim
        mixed = torch.cat([self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)], dim=-1)
        conv = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        conv_w = self.own_part("conv", conv)
        start = conv_start(self.handoff, mixed, conv_w, state)
        kernels = kernels_for(self, x_BSD, "kda")
        mixed, conv_state = kernels.conv(mixed.transpose(1, 2), conv_w, start)
        q, k, v = (t.reshape(B, S, -1, K) for t in mixed.transpose(1, 2).chunk(3, dim=-1))
        gate = self.f_b_proj(self.f_a_proj(x_BSD)).float() + self.own_part("dt_bias", self.dt_bias).float()
        A = self.own_part("A_log", self.A_log.view(-1)).float().exp().view(1, 1, -1, 1)
        g = -A * F.softplus(gate.view(B, S, -1, K))  # [B, S, H, K]
        beta = self.b_proj(x_BSD).sigmoid()
        out, delta = delta_rule(q, k, v, g, beta, state, recurrent, self.chunk, self.handoff, self.fused_chunk_terms,
                                kernels)
        out_gate = self.g_b_proj(self.g_a_proj(x_BSD)).view(B, S, -1, K)
        out = sigmoid_gated_rms_norm(out, out_gate, self.own_part("norm", self.o_norm.weight), self.o_norm.eps)
        seen = S + (0 if state is None else state.tokens)
        out = in_sequence_order(self.handoff, out.reshape(B, S, -1))
        return self.o_proj(out), DeltaNetState(conv_state, delta, seen)
