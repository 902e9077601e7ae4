"""Causal self-attention: multi-head and grouped-query (Ainslie et al. 2023, GQA), with RoPE,
optional QKV bias (Qwen2), QK RMSNorm per head (Qwen3) or over all heads (OLMo 2), a sliding window on
every layer (Mistral) or on some (OLMo 3), layers without RoPE (SmolLM3's NoPE), RoPE on the first
share of each head only (Phi-4-mini's partial rotary), and a softmax scale of its own (Gemma 3's
query_pre_attn_scalar).

The attention core is a seam (`attention_core`, an `AttentionCore`), declared here and injected
like the MoE dispatcher: by default `causal_attention`, causal SDPA over the sequence; context
parallelism (`tessera.parallel`) installs a core with the same signature that attends over the
whole sequence spread across ranks. An inference cache (`tessera.infer`) is passed per call
instead: an object with `attend(layer_id, q, k, v, scale, window)` that stores k/v and attends
over everything cached. Shapes: B batch, S sequence, H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.norm import RMSNorm
from tessera.models.rope import apply_rope


class AttentionCache(Protocol):
    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor: ...


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [Sq, Sk] mask, True where query i may see key j: j <= i and i - j < window."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def causal_attention(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v over one whole sequence; GQA by head groups."""
    S = q_BHSD.shape[2]
    gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
    if window is None or window >= S:
        return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    pos = torch.arange(S, device=q_BHSD.device)
    mask = sliding_window_mask(pos, pos, window)
    return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, scale=scale, enable_gqa=gqa)


# (q [B, H, S, D], k [B, G, S, D], v [B, G, S, Dv], scale, window) -> [B, H, S, Dv], as causal_attention.
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int | None], torch.Tensor]
# Several projections of one input in one product, their outputs in order, or None where it does not
# apply right now (then the modules run one by one): serving on CPU fuses q/k/v and the MLP's gate/up
# (tessera.infer.cpu.linear.fuse_projections); None everywhere else.
FusedProjection = Callable[[torch.Tensor], tuple[torch.Tensor, ...] | None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_core: AttentionCore = causal_attention  # the seam (module docstring)
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.layer_window(layer_id)
        self.rotary = layer_id not in cfg.nope_layers  # False: a NoPE layer (SmolLM3), q and k are not rotated
        self.rotary_dim = cfg.rotary_dim  # the first dims of each head RoPE rotates (partial rotary: fewer)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        # per head over head_dim (Qwen3), or over all heads at once (OLMo 2: qk_norm_all_heads)
        self.qk_norm_all_heads = cfg.qk_norm_all_heads
        q_width, k_width = ((cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim) if cfg.qk_norm_all_heads
                            else (cfg.head_dim, cfg.head_dim))
        self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.fused_qkv: FusedProjection | None = None  # wq, wk, wv in one product (the seam above)
        # (q, k, cos, sin): apply_rope to q and k in place, used without autograd: serving on CPU
        # installs a one-pass kernel (tessera.infer.cpu.layer_ops); None everywhere else
        self.fused_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        qkv = self.fused_qkv(x_BSD) if self.fused_qkv is not None else None
        if qkv is None:
            qkv = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        q, k = qkv[0], qkv[1]
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, -1, self.head_dim)  # [B, S, H, D]; -1 keeps local heads under TP
        k = k.view(B, S, -1, self.head_dim)  # [B, S, G, D]
        v = qkv[2].view(B, S, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary and self.fused_rope is not None and not torch.is_grad_enabled():
            self.fused_rope(q, k, cos, sin)
        elif self.rotary and self.rotary_dim < self.head_dim:
            q, k = (torch.cat((apply_rope(t[..., :self.rotary_dim], cos, sin), t[..., self.rotary_dim:]), dim=-1)
                    for t in (q, k))
        elif self.rotary:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        scale = self.scale
        if cache is not None:
            out = cache.attend(self.layer_id, q, k, v, scale, self.window)
        else:
            out = self.attention_core(q, k, v, scale, self.window)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))
