"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"): one decoder layer that drafts from the target's own hidden states.

The target's residual stream after a low, a middle and a high block count (`feature_layers`, the
block counts of `Transformer.forward`'s `keep_layers`: 0 is the embedding) at position i,
concatenated [3 x D_t], is fused by a linear map to the draft's width (`fc`):

    g_i   = fc [f_low,i ; f_mid,i ; f_high,i]                          (3 D_t -> D)
    x_i   = [RMSNorm_e(Emb(t_{i+1})) ; RMSNorm_h(g_i)]                 (2 D: the attention's input)
    a_i   = g_i + Attention(x_i)                                       (q, k, v take 2 D; o gives D)
    h_i   = a_i + SwiGLU(RMSNorm_f(a_i))                               (the draft's output before its norm)
    P_i   = Head(RMSNorm(h_i))                                         predicts t_{i+2}

Emb is the target's embedding (or the draft's own, where its file carries one); the head is the
draft's own, over the target's vocabulary or a smaller draft vocabulary whose token d is target
token d + d2t[d] (`d2t`; the other target tokens get logit -inf). Drafting further than one token
feeds the draft's own output h in place of g at the next position (never through `fc`).

Training-time test (EAGLE-3, section 3.2): training unrolls the draft `steps` times over a whole
sequence. Step 0 reads g; step j > 0 reads, at position i, step j-1's output at position i-1 (the
draft's state one token earlier), as the chain does in serving. Its attention sees what the chain's
cache holds at that point: step 0's keys and values at positions <= i - j (computed from the target's
features) and step k's at position i - j + k for k = 1..j (`UnrolledAttention`). Every step at
position i predicts t_{i+2}. The module holds no collective; shapes: B batch, S sequence, D width.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention import Attention, AttentionCache
from tessera.models.mlp import FeedForward
from tessera.models.norm import RMSNorm
from tessera.models.rope import rope_cos_sin, rope_frequencies


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """The low, middle and high block counts: vLLM's and SGLang's (2, L // 2, L - 3) where the target
    is deep enough for three distinct ones, else (1, L // 2, L - 1) kept inside 1..L."""
    if n_layers >= 7:
        return 2, n_layers // 2, n_layers - 3
    return 1, max(1, n_layers // 2), max(1, n_layers - 1)


def draft_layer_config(target: ModelConfig) -> ModelConfig:
    """The draft layer's shape from its target's: LLaMA attention (grouped-query, no MLA, no biases or
    QK norm) with the target's width, heads and RoPE, a dense SwiGLU of the target's dense FFN width."""
    heads = target.n_heads
    return replace(target, family="llama", n_layers=1, n_kv_heads=target.n_kv_heads or heads,
                   head_dim=target.dim // heads if target.mla is not None else target.head_dim, mla=None, moe=None,
                   mtp_depth=0, qkv_bias=False, out_bias=False, qk_norm=False, qk_norm_all_heads=False,
                   sliding_window=None, window_layers=None, local_rope_theta=None, nope_layers=[], block_norms="pre",
                   tie_embeddings=False)


class EagleDraft(nn.Module):
    """The draft head (module docstring) for a target of width `target_dim`, layer shape `cfg`
    (`draft_layer_config`; `cfg.vocab_size` is the target's vocabulary), `draft_vocab_size` output
    tokens (None: the target's) and `own_embedding` (False: the caller passes the target's)."""

    def __init__(self, cfg: ModelConfig, feature_layers: tuple[int, ...], target_dim: int,
                 draft_vocab_size: int | None = None, own_embedding: bool = False):
        super().__init__()
        self.cfg, self.feature_layers, self.target_dim = cfg, tuple(int(j) for j in feature_layers), target_dim
        D = cfg.dim
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, D) if own_embedding else None
        self.fc = nn.Linear(len(self.feature_layers) * target_dim, D, bias=False)
        self.embed_norm = RMSNorm(D, cfg.norm_eps)
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id=0)
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.attention.wq = nn.Linear(2 * D, q_out, bias=False)  # [embedding ; hidden] in
        self.attention.wk = nn.Linear(2 * D, kv_out, bias=False)
        self.attention.wv = nn.Linear(2 * D, kv_out, bias=False)
        self.ffn_norm = RMSNorm(D, cfg.norm_eps)
        self.feed_forward = FeedForward(D, cfg.ffn_dim)
        self.norm = RMSNorm(D, cfg.norm_eps)
        self.lm_head = nn.Linear(D, self.draft_vocab_size, bias=False)
        # draft token d is target token d + d2t[d]; None: the draft predicts over the target's vocabulary
        self.d2t: torch.Tensor | None
        if self.draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        inv_freq, self.rope_attention_factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Norm gains 1, every matrix N(0, cfg.init_std) from (seed, its name) alone: each rank the same."""
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            digest = hashlib.sha256(f"eagle:{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, self.cfg.init_std, generator=gen))

    def rope(self, positions_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the draft layer's RoPE at `positions_BS`."""
        return rope_cos_sin(positions_BS, self.rope_inv_freq, self.rope_attention_factor, dtype)

    def fuse(self, features_BSF: torch.Tensor) -> torch.Tensor:
        """g: the target's concatenated features [.., len(feature_layers) x D_t] mapped to [.., D]."""
        return self.fc(features_BSF.to(self.fc.weight.dtype))

    def forward(self, emb_BSD: torch.Tensor, hidden_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """h [B, S, D] (before the final norm) from the token embeddings and g (or the draft's own
        previous output); `cache` as Attention takes it (a paged cache in serving, `UnrolledAttention`
        in training)."""
        x = torch.cat([self.embed_norm(emb_BSD), self.hidden_norm(hidden_BSD)], dim=-1)
        a = hidden_BSD + self.attention(x, cos, sin, cache)
        return a + self.feed_forward(self.ffn_norm(a))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [.., V_draft]."""
        return self.lm_head(self.norm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [.., V]: the draft's, placed by `d2t` (-inf elsewhere)."""
        z = self.draft_logits(h)
        if self.d2t is None:
            return z
        full = z.new_full((*z.shape[:-1], self.cfg.vocab_size), float("-inf"))
        full[..., torch.arange(self.draft_vocab_size, device=z.device) + self.d2t] = z
        return full


class UnrolledAttention:
    """The attention of training-time test's step j over one sequence batch (module docstring): the
    query at position i sees step 0's keys at positions <= i - j and step k's key at i - j + k. Call
    `attend` once per step, in order (the draft's Attention does, given this as its cache)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor:
        self.keys.append(k_BGSD)
        self.values.append(v_BGSD)
        j, S = len(self.keys) - 1, q_BHSD.shape[2]
        i = torch.arange(S, device=q_BHSD.device)[:, None]
        m = torch.arange(S, device=q_BHSD.device)[None, :]
        blocks = [m <= i - j] + [m == i - j + k for k in range(1, j + 1)]
        mask = torch.cat(blocks, dim=1)  # [S, (j + 1) S]
        k, v = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)
        return F.scaled_dot_product_attention(q_BHSD, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q_BHSD.shape[1] != k.shape[1])


def unrolled_outputs(draft: EagleDraft, emb_BSD: torch.Tensor, features_BSF: torch.Tensor, steps: int
                     ) -> list[torch.Tensor]:
    """Training-time test: the draft's outputs h [B, S, D] of steps 0..steps-1 over whole sequences
    (positions 0..S-1; step j's rows at positions < j have no chain behind them, and count no loss)."""
    B, S = emb_BSD.shape[:2]
    positions = torch.arange(S, device=emb_BSD.device).expand(B, S)
    cos, sin = draft.rope(positions, emb_BSD.dtype)
    cache, hidden, outs = UnrolledAttention(), draft.fuse(features_BSF), []
    for _ in range(steps):
        h = draft(emb_BSD, hidden, cos, sin, cache)
        outs.append(h)
        hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # step j-1 at position i-1
    return outs
