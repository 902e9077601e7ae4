"""Attention of each row over exactly its own context, one sequence at a time (on CPU).

The padded paths (`bucketed_decode.BlockTableAttention`, the short-query group of
`paged_attention.PagedAttentionBatch`) gather every row's blocks into [N, L_max] keys and values
and mask the padding: the right shape for a CUDA graph or one kernel launch per layer, but on a CPU
it copies and attends over the longest context N times. With contexts of 32-640 tokens that is
about twice the bytes a step needs, and the fresh tensors of each layer's gather cost more again
(an allocator that returns large blocks to the kernel pays page faults on every reuse).

Here, on CPU: the cache (full precision, or int8 with its scales) is read in place by a C++ kernel, one
call per layer (`infer/cpu/attention.py`), for the short queries and, when the kernel serves the step, its
prompt chunks too. Without it (where the kernel cannot be built, or is turned off) the blocks of
every row's context are gathered once per layer with one `index_select` into a buffer kept by the
cache (`PagedKVCache.gather_flat`), back to back; each row then runs SDPA over its own slice of it,
starting at the first key its window lets any of its queries see. A one-token query needs no mask;
a longer one (speculative tokens to verify, a short prompt chunk) gets a causal bias over its slice,
built on the host once per row and window.
With `PagedKVCache.attention_dtype` set (float64: EngineConfig.fp64_attention) every row takes the
PyTorch ops, in that dtype (the one-query rows as one batch over their contexts padded to the
longest and masked: in float64 the padding's order of sums does not show), and its output is rounded
back to the queries' dtype.
Everything is computed from host lists when the step is built: no op reads device data back.
Shapes: T packed query tokens, H query heads, G stored heads, D head dim, S a row's queries,
L a row's context (the positions before its queries plus the queries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention import ChunkedWindow, Window, first_visible, window_allows
from tessera.models.attention_variants.attention_sinks import sink_attention


@dataclass
class RaggedRow:
    """One row: queries packed at rows [q_row, q_row + S) of the step, context keys at
    [key_at, key_at + L) of the gathered buffer (key_at + i is position i)."""

    q_row: int
    S: int
    L: int
    key_at: int
    biases: dict = field(default_factory=dict)

    def first_key(self, window: Window) -> int:
        """The first position any of the row's queries may see (0 without a window)."""
        return first_visible(self.L - self.S, window)

    def bias(self, window: Window, dtype: torch.dtype) -> torch.Tensor | None:
        """[1, 1, S, L - first_key] additive causal (and window) bias; None for one query."""
        if self.S == 1:
            return None
        if window not in self.biases:
            lo = self.first_key(window)
            q_pos = torch.arange(self.L - self.S, self.L)[:, None]
            diff = q_pos - torch.arange(lo, self.L)[None, :]
            allowed = diff >= 0
            if window is not None:
                allowed &= window_allows(q_pos, torch.arange(lo, self.L)[None, :], window)
            bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            self.biases[window] = bias[None, None]
        return self.biases[window]


class RaggedContexts:
    """The rows of one step and the blocks of their contexts, in order (see the module docstring)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.rows: list[RaggedRow] = []
        self.blocks: list[int] = []
        self.one_query: dict = {}  # by window: the one-query rows as one padded batch (float64 path)

    def add(self, q_row: int, S: int, L: int, block_table: list[int]) -> None:
        n = -(-L // self.block_size)
        self.rows.append(RaggedRow(q_row, S, L, len(self.blocks) * self.block_size))
        self.blocks.extend(block_table[:n])

    def freeze(self, device: torch.device) -> None:
        self.block_index = torch.tensor(self.blocks, dtype=torch.long, device=device)
        # the kernel's view of the rows: (q_row, S, L, first block in block_index) each
        self.rows_R4 = torch.tensor([(r.q_row, r.S, r.L, r.key_at // self.block_size) for r in self.rows],
                                    dtype=torch.long, device=device).reshape(-1, 4)

    def attend(self, kv: PagedKVCache, layer_id: int, q_THD: torch.Tensor, out_THD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> None:
        """Write each row's attention output into out_THD at its query rows. The C++ kernel knows
        sliding windows, not chunks, and takes no attention sinks (gpt-oss): a chunked layer, or one
        with sinks, attends here in Python."""
        chunked = isinstance(window, ChunkedWindow)
        wide = kv.attention_dtype if sinks is None else None  # float64 sums (EngineConfig.fp64_attention)
        if (wide is None and sinks is None and not chunked and q_THD.stride(-1) == 1
                and cpu_attention.usable(kv.k[layer_id], q_THD)):
            scales = (kv.k_scale[layer_id], kv.v_scale[layer_id]) if kv.int8 else (None, None)
            cpu_attention.kernel()(q_THD, out_THD, kv.k[layer_id], kv.v[layer_id], self.rows_R4, self.block_index,
                                   self.block_size, scale, window or 0, *scales)
            return
        dtype = wide or q_THD.dtype
        k_flat, v_flat = kv.gather_flat(layer_id, self.block_index, dtype)  # [slots, G, D]
        gqa = q_THD.shape[1] != k_flat.shape[1]
        batched = wide is not None and not chunked and self._attend_one_query_rows(q_THD, out_THD, k_flat, v_flat,
                                                                                  scale, window, gqa)
        for r in self.rows:
            if batched and r.S == 1:
                continue
            lo = r.first_key(window)
            k = k_flat[r.key_at + lo:r.key_at + r.L].transpose(0, 1)[None]
            v = v_flat[r.key_at + lo:r.key_at + r.L].transpose(0, 1)[None]
            q = q_THD[r.q_row:r.q_row + r.S].transpose(0, 1)[None].to(dtype)
            if sinks is not None:
                o = sink_attention(q, k, v, scale, sinks, r.bias(window, q.dtype))
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=r.bias(window, q.dtype), scale=scale,
                                                   enable_gqa=gqa)
            out_THD[r.q_row:r.q_row + r.S] = o[0].transpose(0, 1)  # rounded back to the queries' dtype

    def _attend_one_query_rows(self, q_THD: torch.Tensor, out_THD: torch.Tensor, k_flat: torch.Tensor,
                               v_flat: torch.Tensor, scale: float, window: Window, gqa: bool) -> bool:
        """The float64 path's one-query rows (decodes) in one SDPA over their contexts padded to the
        longest, the padding and what the window hides masked out (in float64 the padding's order of
        sums does not show once rounded back); False where fewer than two rows have one query."""
        if window not in self.one_query:
            rows = [r for r in self.rows if r.S == 1]
            batch = None
            if len(rows) > 1:
                j = torch.arange(max(r.L for r in rows))
                lo = torch.tensor([r.first_key(window) for r in rows])[:, None]
                at = torch.tensor([r.key_at for r in rows])[:, None]
                seen = (j >= lo) & (j < torch.tensor([r.L for r in rows])[:, None])
                bias = torch.zeros(seen.shape, dtype=k_flat.dtype).masked_fill_(~seen, float("-inf"))
                batch = (torch.tensor([r.q_row for r in rows]), torch.where(seen, at + j, at), bias[:, None, None])
            self.one_query[window] = batch
        if self.one_query[window] is None:
            return False
        q_rows, slots_NL, bias = self.one_query[window]
        N, L = slots_NL.shape
        k = k_flat.index_select(0, slots_NL.flatten()).view(N, L, *k_flat.shape[1:]).transpose(1, 2)
        v = v_flat.index_select(0, slots_NL.flatten()).view(N, L, *v_flat.shape[1:]).transpose(1, 2)
        q = q_THD.index_select(0, q_rows).to(k_flat.dtype)[:, :, None]  # [N, H, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
        out_THD.index_copy_(0, q_rows, o[:, :, 0].to(out_THD.dtype))
        return True
