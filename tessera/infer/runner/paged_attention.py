"""Attention over the paged KV cache for a batch of ragged sequences packed into one row.

Batching choice: the tokens of every scheduled sequence (prefill chunks, single decode tokens,
speculative runs of k+1 tokens) are packed back to back into one row of T tokens, each with its
own absolute position, so the rest of the model (projections, MLPs, MoE routing) sees one
[1, T] batch with no padding. Only attention needs to know which tokens belong together; this
object is the model's `AttentionCache` for one step and does that:

1. write the step's keys/values into their slots (one `index_copy_` per layer);
2. for each group of sequences, gather the blocks of their whole context from the cache into
   padded [N, L] tensors and run SDPA with an additive mask over absolute positions (built once
   per step): key j is visible to query i iff j <= i, j lies inside i's window (i - j < window for a
   sliding window, i's own chunk for chunked attention: `window_allows`) and j lies
   inside the sequence's context;
3. scatter the outputs back to the packed order.

Every index those steps use is built on the host when the batch is made and copied to the device
once (from pinned memory without blocking, on CUDA); `attend` selects with them (`index_select`,
`index_copy_`), so no op of a layer has an output whose size depends on device data: on a GPU such
an op (boolean-mask indexing, `nonzero`) makes the host wait for the device, once per layer.

Short queries (decodes, speculative verification) form one group; each long prefill chunk is a
group of its own, so padding never multiplies a long chunk by the batch size. A chunk that starts
at position 0 attends to its own keys directly (plain causal SDPA, nothing to gather). On CPU nothing
is padded: each sequence attends over exactly its own context (ragged_attention.py), which there
costs less than copying and masking the longest one N times; with the C++ kernel (infer/cpu/attention.py)
every row of the step, prompt chunks included, is one ragged group read in place from the cache in
one call per layer, which also spares a chunk after earlier context the whole square of scores
that SDPA computes under an explicit mask.
With a windowed pool (`PagedKVCache.window_layers`, scheduling/window_blocks.py) the windowed layers
attend through a second batch of the same rows built over the sequences' `window_table`s, rings of
token slots in that pool's blocks (window_ring.py: a prompt chunk that would write over keys its own
queries still see attends to its own keys from the step's tensors).
With the cache's `attention_dtype` set (float64: EngineConfig.fp64_attention) every path attends in
it and rounds its outputs back to the queries' dtype (on CPU without the C++ kernel).
Shapes: T packed tokens, N sequences in a group, S longest query, L longest context, H query heads,
G stored heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.runner.ragged_attention import RaggedContexts
from tessera.infer.runner.sparse_attention import attend_sparse
from tessera.infer.runner.window_ring import WindowRingBatch
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention import (
    ChunkedWindow,
    Window,
    causal_attention,
    masked_attention,
    sees_all,
    wide_causal_attention,
    window_allows,
)
from tessera.models.attention_variants.sparse_mla import KeyChoice

SHORT_QUERY = 16  # queries up to this many tokens share one padded group


@dataclass
class SequenceSlice:
    """One sequence's part of a step: `length` new tokens at positions start..start+length-1."""

    start: int
    length: int
    block_table: list[int]
    window_table: list[int] | None = None  # the windowed layers' blocks (None: the cache has no windowed pool)


@dataclass
class _Group:
    span: tuple[int, int] | None  # packed rows [a, b) when the group is one sequence, else None
    rows: torch.Tensor | None  # [n_valid] packed rows of the group's queries, in (n, s) order
    q_index: torch.Tensor | None  # [N * S] packed row of each padded query, (n, s) flattened (0 where padding)
    valid_index: torch.Tensor | None  # [n_valid] where each valid query sits in the (n, s) flattened order
    valid: torch.Tensor  # [N, S] bool (CPU)
    q_pos: torch.Tensor  # [N, S] (CPU)
    ctx_blocks: torch.Tensor | None  # [N, ceil(L / block_size)] blocks of each context (None: fresh prefill)
    k_valid: torch.Tensor | None  # [N, L] (CPU)
    masks: dict
    ragged: RaggedContexts | None = None  # on CPU: each row over its own context (ragged_attention.py)


class PagedAttentionBatch:
    """The `AttentionCache` of one engine step (see the module docstring)."""

    def __init__(self, kv: PagedKVCache, slices: list[SequenceSlice], device: torch.device | str = "cpu",
                 window_pool: bool = False):
        self.kv, self.device = kv, torch.device(device)
        # the windowed layers' batch: the same rows over the window tables (their blocks' own pool)
        self.windowed: WindowRingBatch | None = None
        if kv.window_layers and not window_pool:
            self.windowed = WindowRingBatch(kv, slices, self.device,
                                            lambda rows: PagedAttentionBatch(kv, rows, device, window_pool=True))
        offsets, t = [], 0
        for s in slices:
            offsets.append(t)
            t += s.length
        self.num_tokens = t
        self.slices, self.offsets = slices, offsets  # for sparse attention (sparse_attention.py)
        # On CPU with the kernel every row is one ragged group (one kernel call per layer); else short
        # queries share a padded group and each long chunk is a group of its own
        self.all_ragged = self.device.type == "cpu" and bool(slices) and cpu_attention.serves(kv)
        if self.all_ragged:
            groups = [list(range(len(slices)))]
        else:
            short = [i for i, s in enumerate(slices) if s.length <= SHORT_QUERY]
            groups = [short] if len(short) > 1 else [[i] for i in short]
            groups += [[i] for i, s in enumerate(slices) if s.length > SHORT_QUERY]
        self.groups: list[_Group] = []
        slot_parts, pos_parts = [None] * len(groups), [None] * len(groups)
        for gi, members in enumerate(groups):
            g, slots_NS = self._group([slices[i] for i in members], [offsets[i] for i in members], kv.block_size)
            self.groups.append(g)
            slot_parts[gi], pos_parts[gi] = slots_NS[g.valid], g.q_pos[g.valid]
        order = torch.tensor([r for members in groups for i in members
                              for r in range(offsets[i], offsets[i] + slices[i].length)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        self.slot_mapping = self._to_device(torch.cat(slot_parts)[inverse])
        self.positions = self._to_device(torch.cat(pos_parts)[inverse])

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the batch's device; on CUDA copied from pinned memory without making
        the host wait for the stream (the copy is queued ahead of the kernels that read it)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _group(self, members: list[SequenceSlice], offs: list[int], bs: int) -> tuple[_Group, torch.Tensor]:
        N, S = len(members), max(m.length for m in members)
        L = max(m.start + m.length for m in members)
        s_idx = torch.arange(S)
        lengths = torch.tensor([m.length for m in members])
        starts = torch.tensor([m.start for m in members])
        valid = s_idx[None, :] < lengths[:, None]
        q_pos = starts[:, None] + s_idx[None, :]
        max_blocks = max(len(m.block_table) for m in members)
        tables = torch.tensor([m.block_table + [0] * (max_blocks - len(m.block_table)) for m in members])
        ctx_blocks = tables[:, :-(-L // bs)]
        slots_NS = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1).gather(1, q_pos.clamp(max=L - 1))
        fresh = N == 1 and members[0].start == 0
        k_valid = None if fresh else torch.arange(L)[None, :] < (starts + lengths)[:, None]
        if N == 1 and not self.all_ragged:
            span = (offs[0], offs[0] + members[0].length)
            ctx = None if fresh else self._to_device(ctx_blocks)
            return _Group(span, None, None, None, valid, q_pos, ctx, k_valid, {}), slots_NS
        if self.device.type == "cpu":
            ragged = RaggedContexts(bs)
            for m, o in zip(members, offs):
                ragged.add(o, m.length, m.start + m.length, m.block_table)
            ragged.freeze(self.device)
            return _Group(None, None, None, None, valid, q_pos, None, k_valid, {}, ragged), slots_NS
        q_index = torch.where(valid, torch.tensor(offs)[:, None] + s_idx[None, :], 0)
        valid_index = valid.flatten().nonzero().flatten()  # on the host, once per step
        return _Group(None, self._to_device(q_index[valid]), self._to_device(q_index.flatten()),
                      self._to_device(valid_index), valid, q_pos, self._to_device(ctx_blocks), k_valid, {}), slots_NS

    def _mask(self, g: _Group, window: Window, dtype: torch.dtype) -> torch.Tensor | None:
        """[N, 1, S, L] additive, in the queries' dtype: 0 where key j is visible to query i (causal
        over absolute positions, inside the context, inside the window), -inf elsewhere. None when
        nothing is masked (one query at the end of a context shorter than the window). Built once
        per step and window; SDPA would otherwise turn a boolean mask into this in every layer."""
        if window not in g.masks:
            L = g.k_valid.shape[1]
            if g.span is not None and g.q_pos.shape[1] == 1 and sees_all(window, L):
                g.masks[window] = None
                return None
            k_pos = torch.arange(L)
            diff = g.q_pos[:, :, None] - k_pos[None, None, :]
            allowed = (diff >= 0) & g.k_valid[:, None, :]
            if window is not None:
                allowed &= window_allows(g.q_pos[:, :, None], k_pos[None, None, :], window)
            allowed |= (~g.valid)[:, :, None] & (k_pos == 0)  # padding rows: no all-masked NaN rows
            bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            g.masks[window] = self._to_device(bias[:, None])
        return g.masks[window]

    def _context(self, layer_id: int, g: _Group, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, L, G, D] of the group's contexts (their blocks, cut at L)."""
        L = g.k_valid.shape[1]
        if g.span is not None:  # one sequence: its blocks back to back (into reused buffers on CPU)
            k, v = self.kv.gather_flat(layer_id, g.ctx_blocks[0], dtype)
            return k[None, :L], v[None, :L]
        k, v = self.kv.gather_blocks(layer_id, g.ctx_blocks, dtype)
        return k[:, :L], v[:, :L]

    def ragged_plan(self, layer_id: int, window: Window) -> tuple[torch.Tensor, RaggedContexts] | None:
        """(the step's cache slots [T], its rows) where layer `layer_id` is read in place by the C++
        kernel exactly as `attend` would (a fused layer then writes and attends itself:
        infer/cpu/gguf_layer.py), else None."""
        if (not self.all_ragged or self.kv.attention_dtype is not None or isinstance(window, ChunkedWindow)
                or (self.windowed is not None and layer_id in self.kv.window_layers)):
            return None
        return self.slot_mapping, self.groups[0].ragged

    def attend_sparse(self, layer_id: int, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                      scale: float, index_keys_BSD: torch.Tensor, choose: KeyChoice) -> torch.Tensor:
        """DeepSeek-V3.2's sparse attention (sparse_attention.py), each sequence over its own context."""
        return attend_sparse(self.kv, self.slices, self.offsets, self.slot_mapping, layer_id, q_BHSD, k_BHSD,
                             v_BHSD, scale, index_keys_BSD, choose)

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.windowed is not None and layer_id in self.kv.window_layers:
            return self.windowed.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, window, sinks)
        q_THD = q_BHSD[0].transpose(0, 1)
        k_TGD, v_TGD = k_BGSD[0].transpose(0, 1), v_BGSD[0].transpose(0, 1)
        self.kv.write(layer_id, self.slot_mapping, k_TGD, v_TGD)
        T, H = q_THD.shape[:2]
        gqa = H != k_TGD.shape[1]
        whole = len(self.groups) == 1 and self.groups[0].span is not None  # one sequence: no scatter
        wide = self.kv.attention_dtype
        out_THD = None if whole else q_THD.new_empty(T, H, v_TGD.shape[-1])
        for g in self.groups:
            if g.span is not None:
                a, b = g.span
                q = q_BHSD[:, :, a:b]  # [1, H, S, D]
                if g.ctx_blocks is None:  # a chunk from position 0: its own keys are the whole context
                    core = causal_attention if wide is None else wide_causal_attention
                    o = core(q, k_BGSD[:, :, a:b], v_BGSD[:, :, a:b], scale, window, sinks)
                else:
                    k, v = self._context(layer_id, g, q.dtype)  # [1, L, G, D]
                    o = masked_attention(q, k.transpose(1, 2), v.transpose(1, 2), self._mask(g, window, q.dtype),
                                         scale, gqa, sinks, wide)
                if whole:
                    return o
                out_THD[a:b] = o[0].transpose(0, 1)
                continue
            if g.ragged is not None:
                g.ragged.attend(self.kv, layer_id, q_THD, out_THD, scale, window, sinks)
                continue
            k_NLGD, v_NLGD = self._context(layer_id, g, q_THD.dtype)
            N, S = g.valid.shape
            q_NHSD = q_THD.index_select(0, g.q_index).unflatten(0, (N, S)).transpose(1, 2)
            o = masked_attention(q_NHSD, k_NLGD.transpose(1, 2), v_NLGD.transpose(1, 2),
                                 self._mask(g, window, q_THD.dtype), scale, gqa, sinks, wide)
            o_flat = o.transpose(1, 2).flatten(0, 1)  # [N * S, H, D], (n, s) order
            out_THD.index_copy_(0, g.rows, o_flat.index_select(0, g.valid_index))
        return out_THD.transpose(0, 1)[None]
