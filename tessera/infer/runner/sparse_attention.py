"""DeepSeek-V3.2's sparse attention over the paged KV cache: the `attend_sparse` of an engine step
(`PagedAttentionBatch`, paged_attention.py; the model's side is tessera/models/attention_variants/sparse_mla.py).

The step's keys, values and indexer keys are written into their slots (the indexer keys in the
cache's `index_k`, kv_cache.py), then each sequence of the step on its own: its context's blocks are
gathered (keys, values, indexer keys), the indexer scores the sequence's new queries against every
indexer key of its context under causality over absolute positions, and the queries attend to the
keys it picks. A prompt split into chunks therefore picks, chunk by chunk, what it would pick whole,
and a decode picks over every cached token. One sequence at a time keeps this plain: a sequence's
scores are [S, L] (its queries by its context) and nothing is padded.
Shapes: T packed tokens, H heads, S a sequence's new tokens, L its context, D head dim, D_i indexer dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention_variants.sparse_gather import attend_gathered, chosen_indices, gathers
from tessera.models.attention_variants.sparse_mla import KeyChoice


def attend_sparse(kv: PagedKVCache, slices, offsets: list[int], slot_mapping: torch.Tensor, layer_id: int,
                  q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
                  index_keys_BSD: torch.Tensor, choose: KeyChoice) -> torch.Tensor:
    """[1, H, T, V]: each sequence's queries over the keys the indexer picks in its context (module
    docstring). `slices` are the step's `SequenceSlice`s, `offsets` where each starts in the packed row."""
    q_THD = q_BHSD[0].transpose(0, 1)
    kv.write(layer_id, slot_mapping, k_BHSD[0].transpose(0, 1), v_BHSD[0].transpose(0, 1))
    kv.write_index_keys(layer_id, slot_mapping, index_keys_BSD[0])
    out_THD = q_THD.new_empty(q_THD.shape[0], q_THD.shape[1], v_BHSD.shape[-1])
    device = q_THD.device
    for s, off in zip(slices, offsets, strict=True):
        L = s.start + s.length
        blocks = torch.tensor(s.block_table[:-(-L // kv.block_size)], device=device)
        keys_LD = kv.gather_index_keys(layer_id, blocks)[:L]
        q_pos = torch.arange(s.start, L, device=device)
        allowed_SL = torch.arange(L, device=device)[None, :] <= q_pos[:, None]
        rows = slice(off, off + s.length)
        chosen_SL = choose(rows, keys_LD, allowed_SL)[0]
        if gathers(s.length, choose.topk, L):  # the chosen slots only (sparse_gather.py)
            out_THD[rows] = _attend_chosen_slots(kv, layer_id, blocks, q_THD[rows], chosen_SL, choose.topk, scale)
            continue
        k_LHD, v_LHD = kv.gather_flat(layer_id, blocks, q_THD.dtype)
        q = q_THD[rows].transpose(0, 1)[None]  # [1, H, S, D]
        o = F.scaled_dot_product_attention(q, k_LHD[:L].transpose(0, 1)[None], v_LHD[:L].transpose(0, 1)[None],
                                           attn_mask=chosen_SL[None, None], scale=scale)
        out_THD[rows] = o[0].transpose(0, 1)
    return out_THD.transpose(0, 1)[None]


def _attend_chosen_slots(kv: PagedKVCache, layer_id: int, blocks: torch.Tensor, q_SHD: torch.Tensor,
                         chosen_SL: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    """[S, H, V]: a sequence's queries over the keys and values of their chosen tokens, read from their slots."""
    idx_SK, valid_SK = chosen_indices(chosen_SL, topk)
    slots = blocks[idx_SK // kv.block_size] * kv.block_size + idx_SK % kv.block_size
    k, v = kv.gather_slots(layer_id, slots.flatten(), q_SHD.dtype)
    S, K = idx_SK.shape
    return attend_gathered(q_SHD, k.view(S, K, *k.shape[1:]), v.view(S, K, *v.shape[1:]), valid_SK, scale)
