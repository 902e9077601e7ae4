"""The windowed layers' attention over each sequence's ring of token slots (scheduling/window_blocks.py).

A sequence's `window_table` repeats its ring's blocks, so position t lives in slot t mod R (R =
`PagedKVCache.window_ring`) and every paged path reads the positions of a window from it unchanged,
as long as the step's own writes leave them in place. A step of C keys from position s writes over
positions s - R..s + C - 1 - R; its first query needs the keys from `first_visible(s, window)`. When
the last key overwritten lies before that (always for a decode step, and for k speculative tokens
since R >= window + k) the rows attend through a `PagedAttentionBatch` over the window tables, as
any row does (the C++ kernel, the padded groups, the static-shape decode step). Otherwise (a prompt
chunk past the ring's first turn: it "wraps") the row attends here, one sequence at a time: the
older keys it sees are read from the ring before anything is written, its own keys come from the
step's K/V tensors, a bias over absolute positions keeps causality and the window, and only then
are the chunk's keys written that no later key of it writes over: its last min(C, R), or more where
the table took fresh blocks in place of the ring's (blocks the prefix cache is to keep). With the
cache's `attention_dtype` set (float64: EngineConfig.fp64_attention) both kinds of row attend in it
and round back, as paged_attention.py's paths do (a layer with attention sinks keeps its fp32 softmax there too).

Which rows wrap depends on the layer's window, so the split is made once per window of the step,
at the first layer that has it. Shapes: T packed tokens, H query heads, G stored heads, D head dim,
C a row's queries, L its keys (the older ones it sees, then its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.models.attention import Window, first_visible, masked_attention, window_allows


@dataclass
class _WrappingRow:
    """One wrapping row of the step under one window: its packed rows, where its older keys lie
    in the ring, the bias over its keys and the slots its last keys go to."""

    rows: tuple[int, int]  # packed rows [a, b)
    old_blocks: torch.Tensor | None  # ring blocks of the older keys it sees (None: it sees none)
    old_at: int  # the first older key's offset in those blocks' slots
    n_old: int  # how many older keys it sees
    bias: torch.Tensor  # [1, 1, C, L] additive
    own: torch.Tensor  # [n] which of its own keys are written: those no later key of the row writes over
    slots: torch.Tensor  # [n] the slots those keys are written to


@dataclass
class _Split:
    inner: object | None  # the rows that do not wrap: a PagedAttentionBatch over their window tables
    inner_rows: torch.Tensor | None  # their packed rows (None: every row of the step)
    wrapping: list[_WrappingRow]


class WindowRingBatch:
    """The windowed layers' `AttentionCache` of one step (see the module docstring)."""

    def __init__(self, kv: PagedKVCache, slices: list, device: torch.device, paged: Callable[[list], object]):
        """`slices`: the step's `SequenceSlice`s; `paged(slices)`: the `PagedAttentionBatch` of those
        slices over the windowed pool (rows whose block_table is their window table)."""
        if any(s.window_table is None for s in slices):
            raise ValueError("a cache with a windowed pool needs every sequence's window_table")
        self.kv, self.slices, self.device, self.paged = kv, slices, device, paged
        self.offsets = [sum(s.length for s in slices[:i]) for i in range(len(slices))]
        self.splits: dict[Window, _Split] = {}

    def _wraps(self, s, window: Window) -> bool:
        """Whether the step's writes of `s` reach a key its first query still sees."""
        return s.start + s.length - 1 - self.kv.window_ring >= first_visible(s.start, window)

    def _split(self, window: Window) -> _Split:
        if window in self.splits:
            return self.splits[window]
        wraps = [self._wraps(s, window) for s in self.slices]
        rest = [i for i, w in enumerate(wraps) if not w]
        inner = None
        if rest:
            inner = self.paged([replace(self.slices[i], block_table=self.slices[i].window_table, window_table=None)
                                for i in rest])
        rows = None
        if len(rest) < len(self.slices) and rest:
            spans = [(self.offsets[i], self.offsets[i] + self.slices[i].length) for i in rest]
            rows = torch.tensor([r for a, b in spans for r in range(a, b)], device=self.device)
        wrapping = [self._wrapping_row(self.slices[i], self.offsets[i], window) for i, w in enumerate(wraps) if w]
        self.splits[window] = _Split(inner, rows, wrapping)
        return self.splits[window]

    def _wrapping_row(self, s, offset: int, window: Window) -> _WrappingRow:
        bs, table = self.kv.block_size, s.window_table
        lo, end = first_visible(s.start, window), s.start + s.length
        old = None
        if lo < s.start:
            old = torch.tensor(table[lo // bs:-(-s.start // bs)], dtype=torch.long, device=self.device)
        q_pos = torch.arange(s.start, end)[:, None]
        k_pos = torch.arange(lo, end)[None, :]
        allowed = (q_pos >= k_pos) & window_allows(q_pos, k_pos, window)
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[None, None]
        slot_of = [table[p // bs] * bs + p % bs for p in range(s.start, end)]
        last = {slot: j for j, slot in enumerate(slot_of)}  # in a ring of its own: the last min(C, R) keys
        own = sorted(last.values())
        return _WrappingRow((offset, offset + s.length), old, lo % bs, s.start - lo, bias.to(self.device),
                            torch.tensor(own, dtype=torch.long, device=self.device),
                            torch.tensor([slot_of[j] for j in own], dtype=torch.long, device=self.device))

    def attend(self, layer_id: int, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
               scale: float, window: Window, sinks: torch.Tensor | None = None) -> torch.Tensor:
        split = self._split(window)
        if not split.wrapping:
            return split.inner.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, window, sinks)
        out = q_BHSD.new_empty(*q_BHSD.shape[:3], v_BGSD.shape[-1])
        if split.inner is not None:
            rows = split.inner_rows
            out[:, :, rows] = split.inner.attend(layer_id, q_BHSD[:, :, rows], k_BGSD[:, :, rows],
                                                 v_BGSD[:, :, rows], scale, window, sinks)
        for w in split.wrapping:
            a, b = w.rows
            out[:, :, a:b] = self._attend_wrapping(layer_id, w, q_BHSD[:, :, a:b], k_BGSD[0, :, a:b].transpose(0, 1),
                                                   v_BGSD[0, :, a:b].transpose(0, 1), scale, sinks)
        return out

    def _attend_wrapping(self, layer_id: int, w: _WrappingRow, q_1HCD: torch.Tensor, k_CGD: torch.Tensor,
                         v_CGD: torch.Tensor, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """One wrapping row: its older keys from the ring and its own from the step, then its writes."""
        k, v = k_CGD, v_CGD
        if w.old_blocks is not None:
            k_old, v_old = self.kv.gather_flat(layer_id, w.old_blocks, q_1HCD.dtype)
            k = torch.cat([k_old[w.old_at:w.old_at + w.n_old], k_CGD.to(q_1HCD.dtype)])
            v = torch.cat([v_old[w.old_at:w.old_at + w.n_old], v_CGD.to(q_1HCD.dtype)])
        k_1GLD, v_1GLD, bias = k.transpose(0, 1)[None], v.transpose(0, 1)[None], w.bias.to(q_1HCD.dtype)
        # the sink column's explicit softmax for gpt-oss; in the cache's attention_dtype (float64) where it has one
        o = masked_attention(q_1HCD, k_1GLD, v_1GLD, bias, scale, q_1HCD.shape[1] != k.shape[1], sinks,
                             self.kv.attention_dtype)
        self.kv.write(layer_id, w.slots, k_CGD[w.own], v_CGD[w.own])
        return o
