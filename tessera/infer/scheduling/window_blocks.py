"""The windowed layers' blocks: a second pool, in which each sequence keeps a ring of token slots,
so that a long sequence holds exactly its window's blocks per windowed layer.

A layer with a sliding window (Mistral, Gemma 3's local layers, gpt-oss, OLMo 3) or with chunked
attention (Llama 4's rotated layers) reads only the keys of its window. Those layers (`WindowedLayers`:
the layers whose window is shorter than `max_model_len`) store their keys and values in a pool of
their own (`PagedKVCache`'s `window_layers` stores, `num_window_blocks` blocks each); the other
layers keep the one block pool and table of the engine. A sequence holds two tables of the same
length, one entry per block of its positions: `block_table` in the full pool and `window_table`
in this one.

The ring: a sequence takes at most `ring` blocks of this pool (`WindowedLayers.blocks_per_seq`: the
widest window, plus the speculative slots, rounded up to whole blocks; R = ring * block_size slots),
and its `window_table` repeats them: entry i is entry i - ring once the ring is full, so position t
lands in slot t mod R and every attention path keeps reading position t at entry t // block_size.
A query at position p sees at most the window's keys p - w + 1..p, which hold distinct slots since
R >= w, so a decode step (one key written, over position p - R, which no query sees any more) and a
speculative step of k + 1 keys (R >= w + k) read their whole window from the ring, and rejected
drafts overwrite nothing a later query needs. A longer step (a prompt chunk past the ring's first
turn) would overwrite keys its own first queries still need: the runner attends such a chunk's
own keys from its K/V tensors and only the older ones from the ring, then writes the chunk's last
R keys (runner/window_ring.py). The table's entries before the window point at slots that later
positions reuse; no path reads them, since each starts at the window's first key (the packed mask,
the ragged rows' first key, the CPU kernel's first key).

Nothing else changes hands: a block of this pool is one sequence's only (no prefix sharing: the
prefix cache does not know these blocks, and the engine serves windowed models without prefix
reuse; `--windowed-kv kept` keeps every block in the one pool, with prefix caching), preemption
frees both tables and recomputes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.infer.engine.sequence import Sequence
from tessera.models.attention import ChunkedWindow, Window, layer_window, sees_all


@dataclass(frozen=True)
class WindowedLayers:
    """The layers whose window is shorter than the longest sequence, and their windows."""

    layers: frozenset[int]
    windows: tuple[Window, ...]  # the distinct windows of `layers`

    @classmethod
    def of(cls, cfg: ModelConfig, max_model_len: int) -> WindowedLayers | None:
        """The windowed layers of `cfg` served up to `max_model_len` positions; None without any."""
        windows = {i: layer_window(cfg, i) for i in range(cfg.n_layers)}
        layers = frozenset(i for i, w in windows.items() if not sees_all(w, max_model_len))
        if not layers:
            return None
        return cls(layers, tuple(sorted({windows[i] for i in layers}, key=repr)))

    def blocks_per_seq(self, block_size: int, lookahead: int = 0) -> int:
        """The blocks of a sequence's ring: the most keys one query sees (the widest window) and the
        speculative slots, rounded up to whole blocks."""
        span = max(w.size if isinstance(w, ChunkedWindow) else w for w in self.windows)
        return -(-(span + lookahead) // block_size)


class WindowPool:
    """The free list of the windowed layers' blocks and the sequences' `window_table`s (rings of
    `ring` blocks; see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, layers: WindowedLayers, lookahead: int = 0):
        self.num_blocks, self.block_size, self.layers = num_blocks, block_size, layers
        self.ring = layers.blocks_per_seq(block_size, lookahead)
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def held(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds in this pool: its ring (the first `ring` entries of its table)."""
        return seq.window_table[:self.ring]

    def need(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq.window_table` must take to hold `num_tokens` positions."""
        return max(0, min(self.ring, -(-num_tokens // self.block_size)) - min(self.ring, len(seq.window_table)))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.window_table` to `num_tokens` positions (the caller checked `need`): new blocks
        until the ring is full, then its blocks again in turn."""
        table = seq.window_table
        for i in range(len(table), -(-num_tokens // self.block_size)):
            table.append(self.free.popleft() if i < self.ring else table[i - self.ring])

    def free_sequence(self, seq: Sequence) -> None:
        self.free.extend(self.held(seq))
        seq.window_table = []

    def forget_all(self) -> None:
        self.free = deque(range(self.num_blocks))
