"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next's hybrid layers.

A decoder block's mixer (`TransformerBlock.attention`) is this module on the layers
`model.linear_attention.layers` lists, softmax attention on the others. Per token it projects
q, k (per key head), v and an output gate z (per value head) in one product laid out per key-head
group as HuggingFace's `in_proj_qkvz` is ([q | k | v of the group's value heads | their z]), and
b, a per value head (`in_proj_ba`, [b | a] per group). q, k and v pass a short causal depthwise
convolution with SiLU; then the gated delta rule (delta_rule.py) with beta = sigmoid(b) and
log-decay g = -exp(A_log) * softplus(a + dt_bias), each key head serving n_value_heads /
n_key_heads consecutive value heads; the output is RMS-normed per head, gated by silu(z)
(`GatedRMSNorm`), and projected back (`out_proj`).

Qwen3.5 lays the same projections out otherwise (`model.linear_attention.projections` "split"):
`in_proj_qkv` holds all heads' q, then k, then v (the convolution's channel order), `in_proj_z`,
`in_proj_b` and `in_proj_a` each its part per value head; the layer computes the same thing. Under
tensor parallelism in_proj_z, in_proj_b and in_proj_a are cut by rows (value heads), and in_proj_qkv,
whose rows of one rank are three ranges, is read through `own_part` ("qkv": this rank's rows, as the
convolution's channels; "input": the input, whose gradient from them is summed over the ranks).

Its recurrent state (`DeltaNetState`: the convolution's last inputs and the delta rule's state) is
what an attention layer's key/value cache is to it: a fixed size per sequence, whatever its length.
`mix(x, state)` takes and returns it, so a sequence fed in pieces equals it fed whole. Given an
inference cache (the `forward` argument attention layers get) it reads and keeps the state there,
through `recurrent_state(layer_id)` / `keep_recurrent_state(layer_id, state)`
(`RecurrentStateCache`). The serving engine's cache of a packed step (many sequences' tokens in one
row) offers `mix_recurrent(layer_id, mix, x)` instead (`PackedRecurrentCache`): it runs this layer's
`mix` over each sequence's tokens from that sequence's state slot (tessera/infer/runner/recurrent_step.py).
Prompts and training run the chunked form, a single new token the recurrent one (equal; tested).

Under tensor parallelism each rank runs whole key-head groups (its in_proj_qkvz / in_proj_ba
columns, out_proj rows; HuggingFace's layout is per group, so a rank's part is contiguous). The
tensors all heads' channels share a dimension of, the convolution's taps ([q | k | v] channels),
A_log and dt_bias (per value head), and the gated norm's weight (shared by all heads), are read
through a seam, `own_part` (an `OwnPart`: (name, tensor) -> this rank's part of it): whole on one
process; tensor parallelism installs one that slices this rank's channels and heads and sums the
gradient over the ranks (tessera/parallel/tensor_parallel.py). Where the sequence starts is a seam
too, `handoff` (a `StateHandoff`, handoff.py): None on one process, where the input is the whole
sequence; context parallelism installs one under which each rank runs the chunked form over its own
part of the sequence only, from the convolution inputs and delta state the previous part hands on.
A third, `fused_chunk_terms` (delta_rule.py's `ChunkTerms`), lays out the chunked form's inputs in
one pass where no gradient is wanted: None (the PyTorch ops) but where the serving engine installs the
CPU library's kernel (tessera/infer/cpu/layer_ops.py). Which kernels run the convolution and the delta
rule is chosen at the first call and kept in `kernels` (cuda_kernels.py: the PyTorch forms, or on CUDA
flash-linear-attention's and causal-conv1d's; `kernel_choice(layer)` says which).
Shapes: B batch, S sequence, D model dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.errors import ParallelError
from tessera.config.model import ModelConfig
from tessera.models.linear_attention.cuda_kernels import RecurrentKernels, kernels_for
from tessera.models.linear_attention.delta_rule import (
    ChunkTerms,
    chunked_delta_rule,
    recurrent_delta_rule,
)
from tessera.models.linear_attention.handoff import StateHandoff, handed_on_delta_rule, in_sequence_order
from tessera.models.norm import RMSNorm


@dataclass
class DeltaNetState:
    """One layer's recurrent state of a batch of sequences: the convolution's last W-1 inputs
    [B, channels, W-1], the delta rule's state [B, value heads, key dim, value dim] (fp32), and
    how many tokens it has read."""

    conv: torch.Tensor
    delta: torch.Tensor
    tokens: int = 0


class RecurrentStateCache(Protocol):
    def recurrent_state(self, layer_id: int) -> DeltaNetState | None: ...

    def keep_recurrent_state(self, layer_id: int, state: DeltaNetState) -> None: ...


class PackedRecurrentCache(Protocol):
    def mix_recurrent(self, layer_id: int, mix: Callable[..., tuple[torch.Tensor, DeltaNetState]],
                      x_1TD: torch.Tensor) -> torch.Tensor: ...


# (name: "conv", "qkv", "input", "A_log", "dt_bias" or "norm"; the whole tensor) -> the part this rank's heads use.
OwnPart = Callable[[str, torch.Tensor], torch.Tensor]


def whole(name: str, t: torch.Tensor) -> torch.Tensor:
    """The `OwnPart` of one process: every head is here."""
    return t


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) (over the last dim, in fp32, cast back before the weight) * silu(gate)."""
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed * F.silu(gate.float())).to(dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of x (weight * x / rms(x)) times silu(gate), per value head."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return gated_rms_norm(x, gate, self.weight, self.eps)


def conv_start(handoff: StateHandoff | None, mixed_BSC: torch.Tensor, conv_w: torch.Tensor,
               state) -> torch.Tensor | None:
    """The convolution's earlier inputs [B, C, W-1]: the state's, the previous part's under a handoff,
    or None (zeros: a sequence's start)."""
    if handoff is not None:
        w = conv_w.shape[-1] - 1
        if mixed_BSC.shape[1] < w:
            raise ParallelError(f"a context-parallel part of {mixed_BSC.shape[1]} tokens is shorter than the "
                                f"short convolution's {w} earlier inputs; choose a longer train.seq_len or fewer cp")
        return handoff.previous_inputs(mixed_BSC[:, mixed_BSC.shape[1] - w:].transpose(1, 2))
    return None if state is None else state.conv


def delta_rule(q, k, v, g, beta, state: DeltaNetState | None, recurrent: bool | None, chunk: int,
               handoff: StateHandoff | None, chunk_terms: ChunkTerms | None = None,
               kernels: RecurrentKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule from `state` in the form `recurrent` picks (default token by token for one
    token, chunked otherwise, its slabs laid out by `chunk_terms` where given), by `kernels`' form where
    it has one (a CUDA library's, cuda_kernels.py), or chunked from the state the previous part hands on.
    q and k may have fewer heads than v, each serving consecutive value heads: a library's form takes them
    so, the PyTorch forms repeat them per value head."""
    recurrent = q.shape[1] == 1 if recurrent is None else recurrent
    form = None if kernels is None or handoff is not None else (kernels.recurrent if recurrent else kernels.chunked)
    start = None if state is None else state.delta
    if form is not None:
        return form(q, k, v, g, beta, start)
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    if handoff is not None:
        return handed_on_delta_rule(q, k, v, g, beta, chunk, handoff)
    if recurrent:
        return recurrent_delta_rule(q, k, v, g, beta, start)
    return chunked_delta_rule(q, k, v, g, beta, start, chunk=chunk, chunk_terms=chunk_terms)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        la = cfg.linear_attention
        self.layer_id = layer_id
        self.key_dim, self.value_dim, self.chunk = la.key_head_dim, la.value_head_dim, la.chunk_size
        self.group = la.n_value_heads // la.n_key_heads  # value heads per key head
        channels = 2 * la.n_key_heads * la.key_head_dim + la.n_value_heads * la.value_head_dim
        self.split = la.projections == "split"
        if self.split:  # Qwen3.5's layout (module docstring)
            self.in_proj_qkv = nn.Linear(cfg.dim, channels, bias=False)
            self.in_proj_z = nn.Linear(cfg.dim, la.n_value_heads * la.value_head_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.dim, la.n_value_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.dim, la.n_value_heads, bias=False)
        else:
            qkvz = la.n_key_heads * (2 * la.key_head_dim + 2 * self.group * la.value_head_dim)
            self.in_proj_qkvz = nn.Linear(cfg.dim, qkvz, bias=False)
            self.in_proj_ba = nn.Linear(cfg.dim, 2 * la.n_value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, la.conv_width, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.n_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.n_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(la.n_value_heads * la.value_head_dim, cfg.dim, bias=False)
        self.own_part: OwnPart = whole  # the seams (module docstring)
        self.handoff: StateHandoff | None = None
        self.fused_chunk_terms: ChunkTerms | None = None
        self.kernels: RecurrentKernels | None = None  # chosen at the first call (cuda_kernels.py)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                cache: RecurrentStateCache | None = None) -> torch.Tensor:
        """The mixer's output; with an inference cache, continuing the state kept there (module
        docstring). `cos` / `sin` are unused: the convolution and the recurrence carry position."""
        if self.handoff is not None:  # cp: this rank's parts of the sequence, each from the one before
            return self.mix(self.handoff.fold(x_BSD))[0]  # the output projected from the sequences put back
        packed = getattr(cache, "mix_recurrent", None)
        if packed is not None:  # the serving engine's packed step: each sequence from its own slot
            return packed(self.layer_id, self.mix, x_BSD)
        state = cache.recurrent_state(self.layer_id) if cache is not None else None
        y, state = self.mix(x_BSD, state)
        if cache is not None:
            cache.keep_recurrent_state(self.layer_id, state)
        return y

    def mix(self, x_BSD: torch.Tensor, state: DeltaNetState | None = None, recurrent: bool | None = None
            ) -> tuple[torch.Tensor, DeltaNetState]:
        """(output [B, S, D], the state after the last token) from `state` (None: a sequence's
        start). `recurrent` picks the form: default token by token for one token, chunked otherwise.
        Under a handoff the rows are parts and the output the sequences they unfold to (`in_sequence_order`)."""
        B, S, _ = x_BSD.shape
        kd, vd, r = self.key_dim, self.value_dim, self.group
        mixed, z, b, a = self._projections(x_BSD)
        hk = b.shape[-1] // r
        conv_w = self.own_part("conv", self.conv1d.weight.squeeze(1))
        start = conv_start(self.handoff, mixed, conv_w, state)
        kernels = kernels_for(self, x_BSD, "gated_delta_rule")
        mixed, conv_state = kernels.conv(mixed.transpose(1, 2), conv_w, start)
        q, k, v = mixed.transpose(1, 2).split([hk * kd, hk * kd, hk * r * vd], dim=-1)
        q, k = q.reshape(B, S, hk, kd), k.reshape(B, S, hk, kd)
        if kernels.chunked is None or self.handoff is not None:  # the PyTorch forms: one q and k per value head
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        v = v.reshape(B, S, hk * r, vd)
        beta = b.sigmoid()
        A_log, dt_bias = self.own_part("A_log", self.A_log), self.own_part("dt_bias", self.dt_bias)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        out, delta = delta_rule(q, k, v, g, beta, state, recurrent, self.chunk, self.handoff, self.fused_chunk_terms,
                                kernels)
        out = gated_rms_norm(out, z, self.own_part("norm", self.norm.weight), self.norm.eps)
        seen = S + (0 if state is None else state.tokens)
        out = in_sequence_order(self.handoff, out.reshape(B, S, -1))
        return self.out_proj(out), DeltaNetState(conv_state, delta, seen)

    def _projections(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's input [B, S, q | k | v channels], the gate z [B, S, value heads, V] and b, a
        [B, S, value heads], from either layout (grouped: each key-head group's q, k, v, z then b, a;
        -1 below: the local key heads under tensor parallelism)."""
        B, S, _ = x_BSD.shape
        kd, vd, r = self.key_dim, self.value_dim, self.group
        if self.split:
            z = self.in_proj_z(x_BSD).view(B, S, -1, vd)
            if self.own_part is whole:
                mixed = self.in_proj_qkv(x_BSD)
            else:  # a rank's q, k, v rows are three ranges: read through the seam as the conv's channels
                mixed = F.linear(self.own_part("input", x_BSD), self.own_part("qkv", self.in_proj_qkv.weight))
            return mixed, z, self.in_proj_b(x_BSD), self.in_proj_a(x_BSD)
        qkvz = self.in_proj_qkvz(x_BSD).view(B, S, -1, 2 * kd + 2 * r * vd)
        q, k, v, z = qkvz.split([kd, kd, r * vd, r * vd], dim=-1)
        b, a = self.in_proj_ba(x_BSD).view(B, S, -1, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], dim=-1)
        return mixed, z.reshape(B, S, -1, vd), b.reshape(B, S, -1), a.reshape(B, S, -1)
