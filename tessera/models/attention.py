"""Causal self-attention: multi-head and grouped-query (Ainslie et al. 2023, GQA), with RoPE,
optional QKV bias (Qwen2), QK RMSNorm per head (Qwen3) or over all heads (OLMo 2), a sliding window on
optional QKV bias (Qwen2), QK RMSNorm per head (Qwen3) or over all heads (OLMo 2), a sliding window on
every layer (Mistral) or on some (OLMo 3, gpt-oss), chunked local attention on the rotated layers (Llama 4's
`ChunkedWindow`), layers without RoPE (SmolLM3's NoPE), RoPE on the first share of each head only
(partial rotary: GLM-4.5, Phi-4-mini, Qwen3-Next), a softmax scale of its own (Gemma 3's
query_pre_attn_scalar), Llama 4's weightless QK norm on the rotated layers and temperature on the
others, an output gate (Qwen3-Next), and attention sinks (gpt-oss: a learned logit per head in the
softmax, passed to the core and the cache as `sinks` where a layer has them; a core or cache without
them is never handed any).

The attention core is a seam (`attention_core`, an `AttentionCore`), declared here and injected
like the MoE dispatcher: by default `causal_attention`, causal SDPA over the sequence; context
parallelism (`tessera.parallel`) installs a core with the same signature that attends over the
whole sequence spread across ranks. An inference cache (`tessera.infer`) is passed per call
instead: an object with `attend(layer_id, q, k, v, scale, window)` that stores k/v and attends
over everything cached. Shapes: B batch, S sequence, H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention_variants.attention_sinks import AttentionSinks, sink_attention
from tessera.models.norm import RMSNorm
from tessera.models.rope import apply_rope


class AttentionCache(Protocol):
    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class ChunkedWindow:
    """Chunked local attention (Llama 4's `attention_chunk_size`): the query at position i sees the
    keys of its own chunk up to itself, positions i - i % size .. i. It goes where a sliding
    window's int goes (the `window` of the attention core and of a cache's `attend`), and is
    hashable, so masks cached per window keep working."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a chunk holds at least one position (size={self.size})")


Window = int | ChunkedWindow | None  # what a layer's attention may see beyond causality (None: everything)


def window_allows(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Window) -> torch.Tensor | bool:
    """Where key position `k_pos` lies inside query position `q_pos`'s window (broadcast; causality
    is the caller's): i - j < window for a sliding window, the same chunk for a `ChunkedWindow`."""
    if window is None:
        return True
    if isinstance(window, ChunkedWindow):
        return torch.div(q_pos, window.size, rounding_mode="floor") == torch.div(k_pos, window.size,
                                                                                  rounding_mode="floor")
    return (q_pos - k_pos) < window


def first_visible(q_pos: int, window: Window) -> int:
    """The first key position the query at `q_pos` may see."""
    if window is None:
        return 0
    if isinstance(window, ChunkedWindow):
        return q_pos - q_pos % window.size
    return max(0, q_pos - window + 1)


def sees_all(window: Window, length: int) -> bool:
    """Whether every query of a sequence of `length` positions from 0 sees all earlier positions."""
    return window is None or (window.size if isinstance(window, ChunkedWindow) else window) >= length


def layer_window(cfg: ModelConfig, layer_id: int) -> Window:
    """The window of layer `layer_id`'s attention: chunks on the rotated layers of a model with
    `attention_chunk_size` (Llama 4), else the layer's sliding window (`ModelConfig.layer_window`)."""
    if cfg.attention_chunk_size is not None and layer_id not in cfg.nope_layers:
        return ChunkedWindow(cfg.attention_chunk_size)
    return cfg.layer_window(layer_id)


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Window) -> torch.Tensor:
    """Boolean [Sq, Sk] mask, True where query i may see key j: j <= i and j inside i's window
    (`window_allows`: i - j < window, or the same chunk)."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= window_allows(q_pos[:, None], k_pos[None, :], window)
    return allowed


def causal_attention(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, scale: float,
                     window: Window = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v over one whole sequence; GQA by head groups; with
    `sinks` [H], each head's sink logit in the softmax (attention_sinks.py)."""
    S = q_BHSD.shape[2]
    gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
    if sinks is not None:
        pos = torch.arange(S, device=q_BHSD.device)
        return sink_attention(q_BHSD, k_BGSD, v_BGSD, scale, sinks, sliding_window_mask(pos, pos, window))
    if sees_all(window, S):
        return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    pos = torch.arange(S, device=q_BHSD.device)
    mask = sliding_window_mask(pos, pos, window)
    return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, scale=scale, enable_gqa=gqa)


def wide_causal_attention(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, scale: float,
                          window: Window = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_attention` with its products and sums in float64, rounded back to the queries' dtype:
    each output is then (all but always) the fp32 value nearest the exact one, whatever order and
    blocking the kernel sums in, so a training forward over whole rows and a serving engine
    attending one query at a time over its cache agree to the bit (GRPO's fp32 scoring,
    tessera.train.modes.grpo; the engine's side: EngineConfig.fp64_attention). A layer with
    attention sinks keeps its fp32 softmax."""
    if sinks is not None or q_BHSD.dtype == torch.float64:
        return causal_attention(q_BHSD, k_BGSD, v_BGSD, scale, window, sinks)
    wide = causal_attention(q_BHSD.double(), k_BGSD.double(), v_BGSD.double(), scale, window)
    return wide.to(q_BHSD.dtype)


def masked_attention(q_NHSD: torch.Tensor, k_NGLD: torch.Tensor, v_NGLD: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, gqa: bool, sinks: torch.Tensor | None = None,
                     wide: torch.dtype | None = None) -> torch.Tensor:
    """SDPA under a mask (additive, or boolean: True where a query sees a key); a layer with attention
    sinks (gpt-oss) takes the explicit softmax with its sink column instead (attention_variants/
    attention_sinks.py). `wide` (float64: the serving cache's `attention_dtype`, GRPO's shared-prefix
    rows): computed in it and rounded back to the queries' dtype, as `wide_causal_attention` does."""
    if sinks is not None:
        return sink_attention(q_NHSD, k_NGLD, v_NGLD, scale, sinks, mask)
    if wide is not None and wide != q_NHSD.dtype:
        return masked_attention(q_NHSD.to(wide), k_NGLD.to(wide), v_NGLD.to(wide),
                                mask if mask is None or mask.dtype == torch.bool else mask.to(wide), scale,
                                gqa).to(q_NHSD.dtype)
    return F.scaled_dot_product_attention(q_NHSD, k_NGLD, v_NGLD, attn_mask=mask, scale=scale, enable_gqa=gqa)


# (q [B, H, S, D], k [B, G, S, D], v [B, G, S, Dv], scale, window) -> [B, H, S, Dv], as causal_attention.
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, Window], torch.Tensor]
# Several projections of one input in one product, their outputs in order, or None where it does not
# apply right now (then the modules run one by one): serving on CPU fuses q/k/v and the MLP's gate/up
# (tessera.infer.cpu.linear.fuse_projections); None everywhere else.
FusedProjection = Callable[[torch.Tensor], tuple[torch.Tensor, ...] | None]


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS(x) over the last dimension, computed in fp32 (Llama 4's weightless QK norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_core: AttentionCore = causal_attention  # the seam (module docstring)
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rotary = layer_id not in cfg.nope_layers  # False: a NoPE layer (SmolLM3), q and k are not rotated
        # a sliding window, or chunks on the rotated layers (model.attention_chunk_size, Llama 4)
        self.window: Window = layer_window(cfg, layer_id)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # gated attention (Qwen3-Next): wq also projects a per-head gate, each head's [q | gate] side by side
        self.output_gate = cfg.attention_output_gate
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim * (2 if self.output_gate else 1), bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        # per head over head_dim (Qwen3), or over all heads at once (OLMo 2: qk_norm_all_heads)
        self.qk_norm_all_heads = cfg.qk_norm_all_heads
        q_width, k_width = ((cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim) if cfg.qk_norm_all_heads
                            else (cfg.head_dim, cfg.head_dim))
        self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.interleaved = cfg.rope_interleave  # rotary pairs side by side (Llama 4), returned as halves
        self.qk_l2_norm = cfg.qk_l2_norm and self.rotary  # Llama 4: unit RMS per head, no weight, rotated layers
        self.norm_eps = cfg.norm_eps
        # a learned logit per head in the softmax (gpt-oss; attention_sinks.py), passed to the core and the cache
        self.sinks = AttentionSinks(cfg.n_heads) if cfg.attention_sinks else None
        self.fused_qkv: FusedProjection | None = None  # wq, wk, wv in one product (the seam above)
        # (q, k, cos, sin): apply_rope to q and k in place, used without autograd: serving on CPU
        # installs a one-pass kernel (tessera.infer.cpu.layer_ops); None everywhere else
        self.fused_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache | None = None, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`q_scale` [B, S, 1, 1] (fp32) multiplies the queries of a layer without RoPE: Llama 4's
        temperature at each position (`Transformer.rope_tables`); None: no scaling."""
        B, S, _ = x_BSD.shape
        qkv = self.fused_qkv(x_BSD) if self.fused_qkv is not None else None
        if qkv is None:
            qkv = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        q, k, gate = qkv[0], qkv[1], None
        if self.output_gate:
            q, gate = q.view(B, S, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(B, S, -1), gate.reshape(B, S, -1)
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, -1, self.head_dim)  # [B, S, H, D]; -1 keeps local heads under TP
        k = k.view(B, S, -1, self.head_dim)  # [B, S, G, D]
        v = qkv[2].view(B, S, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        # the one-pass kernel rotates whole heads in halves: a partial or interleaved rotary goes through apply_rope
        fused = (self.fused_rope is not None and not torch.is_grad_enabled() and not self.interleaved
                 and cos.shape[-1] == self.head_dim)
        if self.rotary and fused:
            self.fused_rope(q, k, cos, sin)
        elif self.rotary:
            q, k = apply_rope(q, cos, sin, self.interleaved), apply_rope(k, cos, sin, self.interleaved)
        if self.qk_l2_norm:
            q, k = unit_rms(q, self.norm_eps), unit_rms(k, self.norm_eps)
        if q_scale is not None and not self.rotary:
            q = (q * q_scale).to(q.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        scale = self.scale
        sinks = {} if self.sinks is None else {"sinks": self.sinks.local()}
        if cache is not None:
            out = cache.attend(self.layer_id, q, k, v, scale, self.window, **sinks)
        else:
            out = self.attention_core(q, k, v, scale, self.window, **sinks)
        out = out.transpose(1, 2).reshape(B, S, -1)
        return self.wo(out if gate is None else out * torch.sigmoid(gate))
