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

Prefix caching: when the block manager names a full block of a sequence in the prefix cache, the
window block of the same positions, if the sequence still holds it, is kept with it (`kept`: named
full block -> window block). Given back, a kept block is not freed but parked, least recently used
first in line for eviction when the pool runs out of free blocks (its cost: the room of the pool,
paid from the KV budget for `max_num_seqs` windows, that running sequences leave); when its full
block is evicted, forgotten or freed, it goes too (`drop`). A sequence that computes a block another
block already names keeps its window block with that one, so evicted window blocks come back. A
prefix of n blocks found in the cache is usable only if every window block a query at position n *
block_size may see is kept (`usable_prefix`), so a hit is cut back to the longest such prefix; a
sequence adopting it takes references to those blocks (`adopt`) and given-back entries before them.
Shared window blocks are full and never written again, as shared full blocks: a sequence writes only
at positions past its prefix. Preemption frees both tables (kept blocks park) and the sequence comes
back through the cache; chunked prefill needs nothing more since a chunk starts at `num_computed`,
whose window is still held. (`--windowed-kv kept` keeps every block in the one pool instead, at a
full layer's memory.)
"""

from __future__ import annotations

from collections import OrderedDict, deque
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
    """The free list of the windowed layers' blocks, their reference counts, and the blocks kept for
    the prefix cache (module docstring: `kept`, `parked`)."""

    def __init__(self, num_blocks: int, block_size: int, layers: WindowedLayers):
        self.num_blocks, self.block_size, self.layers = num_blocks, block_size, layers
        self.released = num_blocks  # the entry of a given-back block: the pool's scratch block (the store has one more)
        self.forget_all()

    def forget_all(self) -> None:
        """Every block free and none kept: the KV cache's contents are gone."""
        self.free: deque[int] = deque(range(self.num_blocks))
        self.ref = [0] * self.num_blocks
        self.kept: dict[int, int] = {}  # named full block -> the window block of the same positions
        self.kept_for: dict[int, int] = {}  # ... and back
        self.parked: OrderedDict[int, None] = OrderedDict()  # kept blocks nobody references, oldest first

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free ones and kept ones nobody references."""
        return len(self.free) + len(self.parked)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def held(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds in this pool (its table's entries not given back)."""
        return [b for b in seq.window_table if b != self.released]

    def need(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq.window_table` must take to hold `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.window_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.window_table` to `num_tokens` positions (the caller checked `need`), taking free
        blocks first, then the least recently used kept one."""
        seq.window_table.extend(self._take() for _ in range(self.need(seq, num_tokens)))

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.parked.popitem(last=False)
            del self.kept[self.kept_for.pop(block)]
        self.ref[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            self.parked.pop(block, None)
        self.ref[block] += 1

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.kept_for:
                self.parked[block] = None
            else:
                self.free.append(block)

    def release_unseen(self, seq: Sequence) -> int:
        """Give back the blocks of `seq` whose positions all lie before the first key its next query
        (at `num_computed`) or any later one may see; returns how many."""
        first = self.layers.first_needed(seq.num_computed) // self.block_size
        given = 0
        for i in range(min(first, len(seq.window_table))):
            if seq.window_table[i] != self.released:
                self._release(seq.window_table[i])
                seq.window_table[i] = self.released
                given += 1
        return given

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references, last block first (a prompt's tail is then evicted before its head)."""
        for b in reversed(self.held(seq)):
            self._release(b)
        seq.window_table = []

    # ---- the prefix cache's share --------------------------------------------------------------
    def keep(self, seq: Sequence, index: int, full_block: int) -> None:
        """Block `index` of `seq` is named in the prefix cache by `full_block` (its own, or another's of
        the same tokens): keep the window block `seq` holds there with it, unless `seq` gave it back
        or `full_block` has one kept already. (A pinned system prompt's window blocks are kept as any,
        not pinned: the pool is sized for running sequences; evicted, they are kept again when a
        request computes the same blocks.)"""
        block = seq.window_table[index] if index < len(seq.window_table) else self.released
        if block != self.released and block not in self.kept_for and full_block not in self.kept:
            self.kept[full_block], self.kept_for[block] = block, full_block

    def drop(self, full_block: int) -> None:
        """`full_block`'s KV is gone (evicted, forgotten, freed unnamed): so is what is kept with it."""
        block = self.kept.pop(full_block, None)
        if block is None:
            return
        del self.kept_for[block]
        if self.ref[block] == 0:  # parked: free now (a referenced one is freed when its last user lets go)
            self.parked.pop(block, None)
            self.free.append(block)

    def _needed(self, n: int) -> range:
        """The block indices whose keys a query after a prefix of `n` blocks may see."""
        return range(max(0, self.layers.first_needed(n * self.block_size)) // self.block_size, n)

    def usable_prefix(self, blocks: list[int]) -> list[int]:
        """The longest start of the cached full `blocks` whose window blocks a query after it may see
        are all kept."""
        n = len(blocks)
        while n and any(blocks[i] not in self.kept for i in self._needed(n)):
            n -= 1
        return blocks[:n]

    def parked_in(self, blocks: list[int]) -> int:
        """How many kept blocks nobody references adopting the prefix `blocks` would reference."""
        return sum(1 for i in self._needed(len(blocks)) if self.ref[self.kept[blocks[i]]] == 0)

    def adopt(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` the kept window blocks of the prefix `blocks` (cut by `usable_prefix`); entries
        before its window are given back already."""
        needed = self._needed(len(blocks))
        seq.window_table = [self.released] * needed.start
        for i in needed:
            block = self.kept[blocks[i]]
            self._acquire(block)
            seq.window_table.append(block)

    def spoiled(self, seq: Sequence) -> list[int]:
        """The blocks only `seq` holds, kept no more (a request failing on inf/NaN: their contents are
        suspect, to be zeroed before another sequence takes them)."""
        own = [b for b in self.held(seq) if self.ref[b] == 1]
        for block in own:
            if block in self.kept_for:
                del self.kept[self.kept_for.pop(block)]
        return own
