"""The windowed layers' blocks: a second pool, whose blocks a sequence gives back once no later
query of it can see them, so that a long sequence holds about a window of them per windowed layer.

A layer with a sliding window (Mistral, Gemma 3's local layers, gpt-oss, OLMo 3) or with chunked
attention (Llama 4's rotated layers) reads only the keys of its window. Those layers (`WindowedLayers`:
the layers whose window is shorter than `max_model_len`) store their keys and values in a pool of
their own (`PagedKVCache`'s `window_layers` stores, `num_window_blocks` blocks each); the other
layers keep the one block pool and table of the engine. A sequence holds two tables of the same
length, one entry per block of its positions: `block_table` in the full pool and `window_table`
in this one. After each step, every entry of `window_table` whose positions all lie before the
first key that the sequence's next query may see (`first_visible` of `num_computed`, the least
over the windowed layers' windows) goes back to the free list, and the entry becomes `released`,
the index of the pool's scratch block: tables keep their positions (block i holds positions
i * block_size..), and no attention ever reads a released entry, because the window excludes its
keys (the packed mask, the ragged rows' first key, the CPU kernel's first key all start inside the
window). A query at position p of a sliding window w sees p - w + 1..p, so a decoding sequence holds
at most ceil(w / block_size) + 1 window blocks (plus its speculative slots); a chunked layer sees
its own chunk only, so everything before the current chunk's start is freed.

Nothing else changes hands: a block of this pool is one sequence's only (no prefix sharing: the
prefix cache does not know these blocks, and the engine serves windowed models without prefix
reuse; `--windowed-kv kept` keeps every block in the one pool, with prefix caching), preemption
frees both tables and recomputes, chunked prefill needs nothing more since a chunk starts at
`num_computed`, whose window is still held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessera.config.model import ModelConfig
from tessera.infer.engine.sequence import Sequence
from tessera.models.attention import ChunkedWindow, Window, first_visible, layer_window, sees_all


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

    def first_needed(self, position: int) -> int:
        """The first key position a query at `position` or later may see on any windowed layer."""
        return min(first_visible(position, w) for w in self.windows)

    def blocks_per_seq(self, block_size: int, lookahead: int = 0) -> int:
        """The most window blocks a decoding sequence holds: its widest window's blocks, one more
        for a window that straddles a block edge, and its speculative slots'."""
        span = max(w.size if isinstance(w, ChunkedWindow) else w for w in self.windows)
        return -(-span // block_size) + 1 + -(-lookahead // block_size)


class WindowPool:
    """The free list of the windowed layers' blocks and the sequences' `window_table`s."""

    def __init__(self, num_blocks: int, block_size: int, layers: WindowedLayers):
        self.num_blocks, self.block_size, self.layers = num_blocks, block_size, layers
        self.released = num_blocks  # the entry of a given-back block: the pool's scratch block (the store has one more)
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def held(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds in this pool (its table's entries not given back)."""
        return [b for b in seq.window_table if b != self.released]

    def need(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq.window_table` must take to hold `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.window_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.window_table` to `num_tokens` positions (the caller checked `need`)."""
        seq.window_table.extend(self.free.popleft() for _ in range(self.need(seq, num_tokens)))

    def release_unseen(self, seq: Sequence) -> int:
        """Give back the blocks of `seq` whose positions all lie before the first key its next query
        (at `num_computed`) or any later one may see; returns how many."""
        first = self.layers.first_needed(seq.num_computed) // self.block_size
        given = 0
        for i in range(min(first, len(seq.window_table))):
            if seq.window_table[i] != self.released:
                self.free.append(seq.window_table[i])
                seq.window_table[i] = self.released
                given += 1
        return given

    def free_sequence(self, seq: Sequence) -> None:
        self.free.extend(self.held(seq))
        seq.window_table = []

    def forget_all(self) -> None:
        self.free = deque(range(self.num_blocks))
