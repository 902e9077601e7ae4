"""DeepSeek-V3.2's sparse attention (DSA, DeepSeek-V3.2-Exp report): a lightning indexer picks, for each
query, the `index_topk` keys it attends to; multi-head latent attention (mla.py) then runs over those
keys only.

The indexer has its own small heads. Query t's score of key s is
    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] / sqrt(D_i)),   w[t] = W_w x[t] / sqrt(H_i),
with indexer queries q[t, j] = W_q c_q[t] from the attention's query latent c_q (so the model needs
`q_lora_rank`), one indexer key per token k[s] = LayerNorm(W_k x[s]) shared by all its heads, and RoPE
on the first qk_rope_head_dim dims of both in the half layout (the attention's own RoPE is
interleaved). Among the keys the query may see (causal), the `index_topk` of highest score are kept;
with as many keys as that or fewer, attention is dense MLA. The selection is not differentiable:
the indexer's weights get no gradient from the language-model loss (transformers' indexer runs under
no_grad), so they are frozen (`requires_grad` false): the optimizer leaves them out and every layout
agrees on that. DeepSeek trains the indexer with a separate KL objective against the main attention
(indexer_loss.py): with `indexer_training` set (train.indexer_loss, tessera.train.indexer_loss) the
layer scores with gradient from detached inputs, attends densely (stage "dense") or over the chosen
keys ("sparse"), and returns its output with that loss (`AttentionLosses`) for the block to hand on.

Without a cache, where the layer's keys come from is a seam, `sequence` (a `KeySpan`): on one process the
input is the whole sequence (`whole_sequence`); context parallelism (tessera.parallel) installs one that
all-gathers every cp rank's keys, values and indexer keys into sequence order, so that each rank's
queries score every key of the sequence, pick their top-k among all of them at their global positions,
and every rank picks what one process picks.

An inference cache is passed the selection as a function, since only it knows each sequence's
context: `attend_sparse(layer_id, q, k, v, scale, index_keys, choose)` stores the step's indexer keys
[B, S, D_i] beside the keys and values and calls `choose(rows, keys_LD, allowed_SL)` for the queries
`rows` of the step (a slice of S) over a context's indexer keys [L, D_i] and causality [S', L],
getting back the keys they attend to [S', L] (tessera/infer/runner/sparse_attention.py), at most
`choose.topk` of them a query (the engine's step gathers them from the cache where they are few:
sparse_gather.py).
Shapes: B batch, S queries, T / L keys, H_i indexer heads, D_i indexer head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention_variants.indexer_loss import (
    LOSS_NAME,
    AttentionLosses,
    HeadSum,
    IndexerTraining,
    all_heads_summed,
    attention_target,
    indexer_kl,
)
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.rope import apply_rope


class KeyChoice(Protocol):
    """(rows of the step's queries, that context's indexer keys [L, D_i], allowed [S', L] bool) -> chosen
    [B, S', L] bool, at most `topk` keys a query."""

    topk: int

    def __call__(self, rows: slice, keys_LD: torch.Tensor, allowed_SL: torch.Tensor) -> torch.Tensor: ...


# (k [B, H, C, N+R], v [B, H, C, V], indexer keys [B, C, D_i] of this process's tokens) -> those of every
# token of the sequence, in sequence order [.., T, ..], and the keys each of this process's queries may see
# [B, C, T] bool (module docstring: the `sequence` seam)
KeySpan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def whole_sequence(k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, index_keys_BSD: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `KeySpan` of one process: the sequence is all here, each query sees itself and the keys before."""
    B, _, S, _ = k_BHSD.shape
    causal = torch.ones(S, S, dtype=torch.bool, device=k_BHSD.device).tril().expand(B, S, S)
    return k_BHSD, v_BHSD, index_keys_BSD, causal


class SparseAttentionCache(Protocol):
    def attend_sparse(self, layer_id: int, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                      scale: float, index_keys_BSD: torch.Tensor, choose: KeyChoice) -> torch.Tensor: ...


def select_keys(scores_BST: torch.Tensor, allowed_BST: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, S, T] bool: the `topk` allowed keys of highest score per query (all of them where fewer
    are allowed). Keys of equal score go to the earlier one (a stable sort): `torch.topk` breaks ties
    by the length of the row, so a query would pick differently over its whole sequence than over a
    cache's context (ReLU makes exact ties common: a key no head scores above 0)."""
    if topk >= scores_BST.shape[-1]:
        return allowed_BST
    masked = scores_BST.masked_fill(~allowed_BST, float("-inf"))
    top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
    return torch.zeros_like(allowed_BST).scatter_(-1, top, True) & allowed_BST


class LightningIndexer(nn.Module):
    """The indexer's weights (transformers' names: wq_b, wk, k_norm, weights_proj) and its scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.n_heads, self.head_dim, self.topk = m.index_n_heads, m.index_head_dim, m.index_topk
        self.wq_b = nn.Linear(m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, m.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(m.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.dim, m.index_n_heads, bias=False)
        self.requires_grad_(False)  # the language-model loss gives them no gradient (module docstring)

    def keys(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One indexer key per token [B, S, D_i], rotated."""
        return apply_rope(self.k_norm(self.wk(x_BSD)).unsqueeze(2), cos, sin, False).squeeze(2)

    def queries(self, x_BSD: torch.Tensor, q_latent_BSL: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries [B, S, H_i, D_i] (fp32, rotated) and head weights [B, S, H_i] (fp32, with
        1 / sqrt(H_i))."""
        B, S, _ = x_BSD.shape
        q = apply_rope(self.wq_b(q_latent_BSL).view(B, S, self.n_heads, self.head_dim), cos, sin, False)
        w = self.weights_proj(x_BSD).float() * self.n_heads ** -0.5
        return q.float(), w

    def scores(self, q_BSHD: torch.Tensor, w_BSH: torch.Tensor, keys_BTD: torch.Tensor) -> torch.Tensor:
        """I [B, S, T] in fp32 (module docstring)."""
        s = torch.matmul(q_BSHD, keys_BTD.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim ** -0.5
        return torch.matmul(w_BSH.unsqueeze(-2), F.relu(s)).squeeze(-2)  # [B, S, 1, H] @ [B, S, H, T]


class IndexerChoice:
    """The `KeyChoice` of a step's queries: the indexer's top-k of their scores against a context's keys."""

    def __init__(self, indexer: LightningIndexer, queries_BSHD: torch.Tensor, weights_BSH: torch.Tensor):
        self.indexer, self.queries, self.weights, self.topk = indexer, queries_BSHD, weights_BSH, indexer.topk

    @torch.no_grad()
    def __call__(self, rows: slice, keys_LD: torch.Tensor, allowed_SL: torch.Tensor) -> torch.Tensor:
        scores = self.indexer.scores(self.queries[:, rows], self.weights[:, rows], keys_LD[None])
        return select_keys(scores, allowed_SL[None].expand(scores.shape[0], -1, -1), self.topk)

class SparseLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention over the keys the indexer picks (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.indexer = LightningIndexer(cfg)
        self.indexer_training: IndexerTraining | None = None  # train.indexer_loss (module docstring)
        self.head_sum: HeadSum = all_heads_summed  # the seam of the indexer loss's target (indexer_loss.py)
        self.sequence: KeySpan = whole_sequence  # the seam of the keys without a cache (module docstring)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: SparseAttentionCache | None = None) -> torch.Tensor | tuple[torch.Tensor, AttentionLosses]:
        B, S, _ = x_BSD.shape
        q, k, v, q_latent = self.project(x_BSD, cos, sin)
        if self.indexer_training is not None and cache is None:
            return self._train_indexer(x_BSD, q_latent, q, k, v, cos, sin)
        with torch.no_grad():  # the choice is not differentiable (module docstring)
            iq, w = self.indexer.queries(x_BSD, q_latent, cos, sin)
            keys = self.indexer.keys(x_BSD, cos, sin)

        if cache is not None:
            out = cache.attend_sparse(self.layer_id, q, k, v, self.scale, keys, IndexerChoice(self.indexer, iq, w))
        else:
            k, v, keys, allowed = self.sequence(k, v, keys)
            with torch.no_grad():
                chosen = select_keys(self.indexer.scores(iq, w, keys), allowed, self.indexer.topk)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None], scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))

    def _train_indexer(self, x_BSD: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, AttentionLosses]:
        """Attention (dense in the warm-up, else over the chosen keys) and the indexer's KL loss
        (indexer_loss.py), the indexer scoring detached inputs with gradient."""
        B, S, _ = x_BSD.shape
        iq, w = self.indexer.queries(x_BSD.detach(), q_latent.detach(), cos, sin)
        k, v, keys, allowed = self.sequence(k, v, self.indexer.keys(x_BSD.detach(), cos, sin))
        scores = self.indexer.scores(iq, w, keys)
        dense = self.indexer_training.stage == "dense"
        chosen = allowed if dense else select_keys(scores.detach(), allowed, self.indexer.topk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None], scale=self.scale)
        target = attention_target(q, k, self.scale, chosen, self.head_sum)
        # the mean over the micro-batch's queries: under cp this rank's share of it (T: the whole sequence)
        loss = indexer_kl(target, scores, chosen).sum() / (B * allowed.shape[-1]) * self.indexer_training.weight
        return self.wo(out.transpose(1, 2).reshape(B, S, -1)), AttentionLosses({LOSS_NAME: loss})
