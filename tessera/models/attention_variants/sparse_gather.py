"""Sparse attention over the chosen keys only (DeepSeek-V3.2's indexer picks at most k of a context's L
keys per query, sparse_mla.py): the chosen keys and values are gathered, [k, H, D] per query, and
softmax attention runs over those, instead of reading every key of the context and masking all but
the chosen (`F.scaled_dot_product_attention` under the chosen mask).

The two are the same attention: a query's softmax over its chosen keys. A query with fewer than k chosen
keys (an early one: fewer keys to see) fills its gathered rows with one of them, masked out.
What the gather saves is reading: S queries read S x k rows of keys and values instead of the context's
L, while the masked form's products run as one dense call. `gathers` says where the gather reads at most
half the rows the masked form reads (a decode over a context longer than 2k: serving's paged step,
tessera/infer/runner/sparse_attention.py, which gathers the chosen slots straight from the KV cache);
a prompt's own queries (S = L) always take the masked form.
Shapes: S queries, K chosen per query, H heads, D key dim, V value dim.
"""

from __future__ import annotations

import torch


def gathers(queries: int, topk: int, keys: int) -> bool:
    """Whether `queries` queries choosing `topk` of `keys` keys each read at most half as many rows gathered."""
    return 2 * queries * topk <= keys


def chosen_indices(chosen_SL: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([S, K] key indices, [S, K] valid) of each query's chosen keys (at most `topk`), K = min(topk, L);
    a query with fewer chosen keys repeats one, marked invalid."""
    K = min(topk, chosen_SL.shape[-1])
    valid, idx = chosen_SL.to(torch.uint8).topk(K, dim=-1, sorted=False)
    return idx, valid.bool()


def attend_gathered(q_SHD: torch.Tensor, k_SKHD: torch.Tensor, v_SKHV: torch.Tensor, valid_SK: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """[S, H, V]: each query's softmax attention over its gathered keys, the invalid ones masked."""
    scores = torch.einsum("shd,skhd->shk", q_SHD, k_SKHD).float() * scale
    weights = scores.masked_fill(~valid_SK[:, None], float("-inf")).softmax(dim=-1).to(v_SKHV.dtype)
    return torch.einsum("shk,skhv->shv", weights, v_SKHV)
