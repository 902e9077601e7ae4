"""The windowed layers' blocks: a second pool, in which each sequence keeps a ring of token slots,
so that a long sequence holds exactly its window's blocks per windowed layer.

A layer with a sliding window (Mistral, Gemma 3's local layers, gpt-oss, OLMo 3) or with chunked
attention (Llama 4's rotated layers) reads only the keys of its window. Those layers (`WindowedLayers`:
the layers whose window is shorter than `max_model_len`) store their keys and values in a pool of
their own (`PagedKVCache`'s `window_layers` stores, `num_window_blocks` blocks each); the other
layers keep the one block pool and table of the engine. A sequence holds two tables of the same
length, one entry per block of its positions: `block_table` in the full pool and `window_table`
in this one.

The ring: a sequence takes `ring` blocks of this pool (`WindowedLayers.blocks_per_seq`: the widest
window, plus the speculative slots, rounded up to whole blocks; R = ring * block_size slots; a few
more under prefix caching, below), and its `window_table` repeats them: entry i is entry i - ring
once the ring is full, so position t lands in slot t mod R and every attention path keeps reading
position t at entry t // block_size. A query at position p sees at most the window's keys p - w +
1..p, which hold distinct slots since R >= w, so a decode step (one key written, over position p -
R, which no query sees any more) and a speculative step of k + 1 keys (R >= w + k) read their whole
window from the ring, and rejected drafts overwrite nothing a later query needs. A longer step (a
prompt chunk past the ring's first turn) would overwrite keys its own first queries still need: the
runner attends such a chunk's own keys from its K/V tensors and only the older ones from the ring,
then writes the chunk's last R keys (runner/window_ring.py; all of them where it took fresh blocks,
below). The table's entries before the window point at slots that later positions reuse; no path
reads them, since each starts at the window's first key (the packed mask, the ragged rows' first
key, the CPU kernel's first key).

Prefix caching: when the block manager names a full block of a sequence in the prefix cache, the
window block of the same positions is kept with it (`kept`: named full block -> window block) if it
still holds them: the sequence holds it and no later entry of its table reuses it. A kept block is
never written again: when the ring comes round to a ring block that is kept, or is to be kept once
the step names it, or that another sequence shares, the sequence takes a fresh block for that ring
slot instead (`grow`), and keeps its reference to the old one only while a query of it may still see
those positions (`release_unseen` after each step gives it back then). So with prefix caching a
prompt chunk longer than the ring takes a block per block of it for its step (the pool has a step's
chunks of room on top of the rings: runner/paged_model.py's `window_pool_blocks`), and writes all
its keys (runner/window_ring.py). Given back, a kept block is not freed but parked, least recently
used first in line for eviction when the pool runs out of free blocks; when its full block is
evicted, forgotten or freed, it goes too (`drop`). A sequence that computes a block another block
already names keeps its window block with that one, so evicted window blocks come back. A prefix of
n blocks found in the cache is usable only if every window block a query at position n * block_size
may see is kept (`usable_prefix`), so a hit is cut back to the longest such prefix; a sequence
adopting it takes references to those blocks (`adopt`): they are its ring's first blocks, each
replaced by a fresh one when the ring comes round to it, as any kept block. The entries before them
are `released`, the index of the pool's scratch block, which no attention reads. So a sequence holds
its ring's blocks and, for less than a window past each turn onto a kept block, that block (a
prompt chunk: its blocks, for its step); the rest of the kept blocks are the cache's, parked and
evictable. Without prefix caching nothing is kept and the ring is only ever reused.
Preemption frees both tables (kept blocks park) and the sequence comes back through the cache.
(`--windowed-kv kept` keeps every block in the one pool instead, at a full layer's memory.)
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
        """The blocks of a sequence's ring: the most keys one query sees (the widest window) and the
        speculative slots, rounded up to whole blocks."""
        span = max(w.size if isinstance(w, ChunkedWindow) else w for w in self.windows)
        return -(-(span + lookahead) // block_size)


class WindowPool:
    """The free list of the windowed layers' blocks, their reference counts, the sequences'
    `window_table`s (rings of `ring` blocks) and the blocks kept for the prefix cache (module
    docstring: `kept`, `parked`)."""

    def __init__(self, num_blocks: int, block_size: int, layers: WindowedLayers, lookahead: int = 0):
        self.num_blocks, self.block_size, self.layers = num_blocks, block_size, layers
        self.ring = layers.blocks_per_seq(block_size, lookahead)
        self.released = num_blocks  # an entry no sequence holds: the pool's scratch block (the store has one more)
        self.caching = False  # whether full blocks are named in a prefix cache (set by the block manager)
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
        """The blocks `seq` holds in this pool: its table's distinct entries that are not `released`
        (its ring, and kept blocks it turned away from that its window still sees), by last use."""
        last = {b: i for i, b in enumerate(seq.window_table) if b != self.released}
        return sorted(last, key=last.__getitem__)

    def _named(self, seq: Sequence, num_tokens: int, named: bool) -> int:
        """How many of `seq`'s blocks the prefix cache will have named once `num_tokens` positions are
        computed (each to be kept: the ring must not come round to them); none where `named` is False
        (scoring, whose pieces are never named)."""
        return min(num_tokens, len(seq.token_ids)) // self.block_size if self.caching and named else 0

    def _reusable(self, table: list[int], index: int, named: int) -> bool:
        """Whether entry `index` (past the ring's first turn) may reuse the block of entry index - ring:
        one not to be kept (`named`: the blocks named by then), that the sequence alone holds."""
        source = index - self.ring
        if source < 0 or source < named:
            return False
        block = table[source]
        return block != self.released and block not in self.kept_for and self.ref[block] == 1

    def need(self, seq: Sequence, num_tokens: int, named: bool = True) -> int:
        """Fresh blocks `seq.window_table` must take to hold `num_tokens` positions (`named`: `grow`'s)."""
        table, n, named = seq.window_table, -(-num_tokens // self.block_size), self._named(seq, num_tokens, named)
        return sum(1 for i in range(len(table), n)
                   if i - self.ring < len(table) and not self._reusable(table, i, named)
                   or len(table) <= i - self.ring < named)

    def grow(self, seq: Sequence, num_tokens: int, named: bool = True) -> None:
        """Extend `seq.window_table` to `num_tokens` positions (the caller checked `need`): new blocks
        until the ring is full, then the ring's blocks again in turn, a fresh one in place of a block
        that is (or is about to be) kept or that another sequence shares (taking free blocks first,
        then the least recently used parked one). `named`: whether the step names its full blocks."""
        table, named = seq.window_table, self._named(seq, num_tokens, named)
        for i in range(len(table), -(-num_tokens // self.block_size)):
            table.append(table[i - self.ring] if self._reusable(table, i, named) else self._take())

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
        """Give back the blocks `seq` turned away from (a later entry of the same ring slot took another
        block) whose positions all lie before the first key its next query (at `num_computed`) or any
        later one may see; returns how many."""
        table, ring = seq.window_table, self.ring
        first = self.layers.first_needed(seq.num_computed) // self.block_size
        given = 0
        for i in range(min(first, len(table) - ring)):
            block = table[i]
            if block != self.released and table[i + ring] != block:
                self._release(block)
                for k in range(i, -1, -ring):  # its entries of earlier turns too
                    if table[k] != block:
                        break
                    table[k] = self.released
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
        the same tokens): keep the window block `seq` holds there with it, unless that block no longer
        holds those positions (given back, or reused by a later entry of its ring slot) or `full_block`
        has one kept already. (A pinned system prompt's window blocks are kept as any, not pinned: the
        pool is sized for running sequences; evicted, they are kept again when a request computes the
        same blocks.)"""
        table = seq.window_table
        block = table[index] if index < len(table) else self.released
        if index + self.ring < len(table) and table[index + self.ring] == block:
            return  # the ring came round to it: later positions are (or will be) written over these
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
        """Give `seq` the kept window blocks of the prefix `blocks` (cut by `usable_prefix`) as its
        ring's first blocks; the entries before them are `released`."""
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
