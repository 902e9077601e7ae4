"""The Mamba-2 mixer (Dao & Gu 2024), the state space layer of Nemotron-H's hybrid layers.

A decoder block's only sublayer on the layers `model.layer_types` marks "mamba" (model.mamba holds
its sizes). Per token one projection, `in_proj`, gives [z | x B C | dt]: the output gate z (n_heads x
head_dim), the convolution's channels (x, then n_groups maps B, then n_groups maps C, each state_size
wide) and a raw step size per head. x, B and C pass a short causal depthwise convolution (with a bias)
and SiLU; then SSD (ssd.py) with dt = softplus(dt + dt_bias) clamped below at dt_min, A = -exp(A_log)
and the skip D; the output y times silu(z) is RMS-normed over each group's channels (`norm`, one
weight over all channels: the gate before the norm, as transformers' NemotronHRMSNormGated) and
projected back (`out_proj`).

Its recurrent state (`Mamba2State`: the convolution's last inputs and the SSD state) is what an
attention layer's key/value cache is to it: a fixed size per sequence. `mix(x, state)` takes and
returns it, so a sequence fed in pieces equals it fed whole. `forward` keeps Gated DeltaNet's
interface (gated_deltanet.py): given an inference cache it reads and keeps the state there
(`recurrent_state(layer_id)` / `keep_recurrent_state`), or, the serving engine's packed step, hands
its `mix` to `mix_recurrent(layer_id, mix, x)`. Prompts and training run the chunked form, a single
new token the recurrent one (equal; tested). Under context parallelism the `handoff` seam (Gated
DeltaNet's, handoff.py) runs each rank's own part of the sequence from the convolution inputs and SSD
state the previous part hands on. Which kernels run the convolution and SSD is chosen at the first call
and kept in `kernels` (cuda_kernels.py: the PyTorch forms, or on CUDA mamba-ssm's
`mamba_chunk_scan_combined` / `selective_state_update` and causal-conv1d's convolution).

Under tensor parallelism each rank runs n_heads / tp heads and the n_groups / tp groups they read
(groups split with their heads). `out_proj` is cut by its input columns; every other tensor stays
whole and is read through the `own_part` seam (Gated DeltaNet's `OwnPart`: whole on one process):
"in_proj" this rank's rows of [z | x B C | dt], "conv" its channels of the convolution's taps and
bias, "heads" its heads' dt_bias, A_log and D, "norm" its channels' gains, "input" the input (whose
gradient from the rank's rows is summed over the ranks; tessera/parallel/tensor_parallel.py).
Shapes: B batch, S sequence, D model dim, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.linear_attention.cuda_kernels import RecurrentKernels, kernels_for
from tessera.models.linear_attention.gated_deltanet import OwnPart, conv_start, whole
from tessera.models.linear_attention.handoff import StateHandoff, handed_on_ssd, in_sequence_order
from tessera.models.linear_attention.ssd import chunked_ssd, recurrent_ssd, step_sizes
from tessera.models.norm import RMSNorm


@dataclass
class Mamba2State:
    """One layer's recurrent state of a batch of sequences: the convolution's last W-1 inputs
    [B, channels, W-1], the SSD state [B, H, P, N] (fp32), and how many tokens it has read."""

    conv: torch.Tensor
    ssm: torch.Tensor
    tokens: int = 0


def group_gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int,
                         eps: float) -> torch.Tensor:
    """weight * rms-normed(y * silu(gate)), the RMS taken over each of `groups` equal slices of the last
    dim, in fp32, cast back to y's dtype before the weight."""
    dtype = y.dtype
    h = y.float() * F.silu(gate.float())
    h = h.unflatten(-1, (groups, -1))
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return weight * h.to(dtype)


class GroupGatedRMSNorm(RMSNorm):
    """`group_gated_rms_norm` with this weight (an RMSNorm, so initialised and counted as one)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__(dim, eps)
        self.groups = groups

    def forward(self, y: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return group_gated_rms_norm(y, gate, self.weight, self.groups, self.eps)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        m = cfg.mamba
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.n_groups, self.state_size = m.n_heads, m.head_dim, m.n_groups, m.state_size
        self.chunk, self.dt_min = m.chunk_size, m.dt_min
        inner = m.n_heads * m.head_dim
        channels = inner + 2 * m.n_groups * m.state_size
        self.in_proj = nn.Linear(cfg.dim, inner + channels + m.n_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(channels, channels, m.conv_width, groups=channels, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.n_heads))
        self.A_log = nn.Parameter(torch.zeros(m.n_heads))
        self.D = nn.Parameter(torch.ones(m.n_heads))
        self.norm = GroupGatedRMSNorm(inner, m.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(inner, cfg.dim, bias=m.proj_bias)
        self.own_part: OwnPart = whole  # the seams (module docstring)
        self.handoff: StateHandoff | None = None
        self.kernels: RecurrentKernels | None = None  # chosen at the first call (cuda_kernels.py)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """The mixer's output; with an inference cache, continuing the state kept there (module
        docstring). `cos` / `sin` are unused: the convolution and the recurrence carry position."""
        if self.handoff is not None:  # cp: this rank's parts of the sequence, each from the one before
            return self.mix(self.handoff.fold(x_BSD))[0]  # the output projected from the sequences put back
        packed = getattr(cache, "mix_recurrent", None)
        if packed is not None:
            return packed(self.layer_id, self.mix, x_BSD)
        state = cache.recurrent_state(self.layer_id) if cache is not None else None
        y, state = self.mix(x_BSD, state)
        if cache is not None:
            cache.keep_recurrent_state(self.layer_id, state)
        return y

    def mix(self, x_BSD: torch.Tensor, state: Mamba2State | None = None, recurrent: bool | None = None
            ) -> tuple[torch.Tensor, Mamba2State]:
        """(output [B, S, D], the state after the last token) from `state` (None: a sequence's
        start). `recurrent` picks the form: default token by token for one token, chunked otherwise."""
        B, S, _ = x_BSD.shape
        own = self.own_part
        A_log = own("heads", self.A_log)
        H, P, N = A_log.shape[0], self.head_dim, self.state_size  # this rank's heads and groups
        G = self.n_groups * H // self.n_heads
        z, xBC, dt = self._projected(x_BSD).split([H * P, H * P + 2 * G * N, H], dim=-1)
        bias = None if self.conv1d.bias is None else own("conv", self.conv1d.bias)
        conv_w = own("conv", self.conv1d.weight.squeeze(1))
        kernels = kernels_for(self, x_BSD, "ssd")
        xBC, conv_state = kernels.conv(xBC.transpose(1, 2), conv_w, conv_start(self.handoff, xBC, conv_w, state), bias)
        x, Bm, Cm = xBC.transpose(1, 2).split([H * P, G * N, G * N], dim=-1)
        args = (x.reshape(B, S, H, P), step_sizes(dt, own("heads", self.dt_bias), self.dt_min), -A_log.float().exp(),
                Bm.reshape(B, S, G, N), Cm.reshape(B, S, G, N), own("heads", self.D))
        recurrent, start = S == 1 if recurrent is None else recurrent, None if state is None else state.ssm
        if self.handoff is not None:
            y, ssm = handed_on_ssd(*args, self.chunk, self.handoff)
        elif recurrent:
            y, ssm = (kernels.recurrent or recurrent_ssd)(*args, start)
        else:
            y, ssm = (kernels.chunked or chunked_ssd)(*args, start, chunk=self.chunk)
        y = group_gated_rms_norm(y.reshape(B, S, H * P), z, own("norm", self.norm.weight), G, self.norm.eps)
        seen = S + (0 if state is None else state.tokens)
        y = in_sequence_order(self.handoff, y.to(x_BSD.dtype))
        return self.out_proj(y), Mamba2State(conv_state, ssm, seen)

    def _projected(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """in_proj of x: [z | x B C | dt] of this rank's heads and groups (all of them on one process)."""
        if self.own_part is whole:
            return self.in_proj(x_BSD)
        bias = None if self.in_proj.bias is None else self.own_part("in_proj", self.in_proj.bias)
        return F.linear(self.own_part("input", x_BSD), self.own_part("in_proj", self.in_proj.weight), bias)
