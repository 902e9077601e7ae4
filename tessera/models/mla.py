"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1).

Keys and values are decompressed from one low-rank latent c_kv = RMSNorm(W_dkv x) shared by all
heads; queries optionally from a low-rank latent too. Position enters only through a decoupled
part: q_rope per head and one k_rope shared by all heads, rotated by RoPE; the rest (q_nope,
k_nope) carries no position. A layer of `model.nope_layers` rotates neither (Kimi Linear's MLA
layers: no positional encoding at all, the recurrent layers carry position).
Score = (q_nope . k_nope + q_rope . k_rope) * scale.
The one k_rope is a seam, `share_rope_key` (a `RopeKeyShare`), like the attention core: every
head uses it, so its gradient is the sum over all heads. On one process autograd sums over them
already (`all_heads_here`); when tensor parallelism spreads the heads over ranks
(`tessera.parallel`), it installs an identity whose backward also sums over the ranks' heads.
Shapes: B batch, S sequence, H heads, L latent rank, N nope dim, R rope dim, V value dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention import AttentionCache, AttentionCore, causal_attention
from tessera.models.norm import RMSNorm
from tessera.models.rope import apply_rope, yarn_softmax_scale

# k_rope [B, S, R] -> the same values, as this process's heads use them (module docstring).
RopeKeyShare = Callable[[torch.Tensor], torch.Tensor]


def all_heads_here(k_rope_BSR: torch.Tensor) -> torch.Tensor:
    """The `RopeKeyShare` of one process: every head is here."""
    return k_rope_BSR


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_core: AttentionCore = causal_attention  # the seam (attention.py docstring)
        self.share_rope_key: RopeKeyShare = all_heads_here  # the seam (module docstring)
        m = cfg.mla
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        self.interleaved = m.rope_interleave
        self.rotary = layer_id not in cfg.nope_layers  # False: q_rope and k_rope pass unrotated (Kimi Linear)
        qk = self.nope + self.rope
        if m.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * qk, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(m.q_lora_rank, 1e-6)
            self.wq_b = nn.Linear(m.q_lora_rank, cfg.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(m.kv_lora_rank, cfg.n_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * m.v_head_dim, cfg.dim, bias=False)
        self.scale = qk**-0.5 * yarn_softmax_scale(cfg.rope_scaling)

    def project(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [B, H, S, N+R], k [B, H, S, N+R], v [B, H, S, V] of the input, and the query latent
        [B, S, q_lora_rank] they came from (None without one), which sparse attention's indexer reads."""
        B, S, _ = x_BSD.shape
        q_latent = None if hasattr(self, "wq") else self.q_norm(self.wq_a(x_BSD))
        q = self.wq(x_BSD) if q_latent is None else self.wq_b(q_latent)
        q = q.view(B, S, -1, self.nope + self.rope)  # [B, S, H, N+R]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        kv_a = self.wkv_a(x_BSD)  # [B, S, L+R]
        c_kv, k_rope = kv_a.split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, S, -1, self.nope + self.v_dim)  # [B, S, H, N+V]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.share_rope_key(k_rope).unsqueeze(2)  # [B, S, 1, R]
        if self.rotary:
            q_rope = apply_rope(q_rope, cos, sin, self.interleaved)
            k_rope = apply_rope(k_rope, cos, sin, self.interleaved)
        H = q_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # [B, H, S, N+R]
        k = torch.cat((k_nope, k_rope.expand(B, S, H, self.rope)), dim=-1).transpose(1, 2)
        return q, k, v.transpose(1, 2), q_latent  # v [B, H, S, V]

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v, _ = self.project(x_BSD, cos, sin)
        if cache is not None:
            out = cache.attend(self.layer_id, q, k, v, self.scale, None)
        else:
            out = self.attention_core(q, k, v, self.scale, None)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))
