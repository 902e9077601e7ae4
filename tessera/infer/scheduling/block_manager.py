"""Paged KV-cache bookkeeping (Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention"): fixed-size blocks, a block table per sequence, reference
counts so that sequences can share the blocks of a common prefix.

A block is free (in `free`), referenced (ref > 0), or unreferenced but still named in the prefix
cache (reusable until evicted). Allocation takes free blocks first, then evicts the least
recently used named block. Blocks shared through the prefix cache are full and never written
again: a sequence only writes at positions >= its `num_computed`, which lie past them.

With KV tiers (`kv_tiers.py`) an evicted named block is handed to the tier planner first, to be
kept in host memory or on disk, and a prefix lookup goes on below the device where the device's
chain ends (`find_below`); blocks found there get fresh device blocks filled before the forward.

With a `WindowPool` (window_blocks.py) the windowed layers' blocks come from a second pool: every
allocation takes from both, a sequence's window blocks being a ring that stops growing at its
window's blocks. A named block keeps the window block of its positions with it (until either is
evicted; the ring takes a fresh block rather than write over a kept one), after each step the kept
blocks no later query of a sequence sees are given back (`register_computed`), and a prefix found is
cut back to the longest one whose window blocks a query after it sees are all kept.

A hybrid model's recurrent-state snapshots (state_snapshots.py) are kept beside named blocks: a block's
snapshot is dropped when the block is evicted, forgotten or freed unnamed, and a prefix found is cut
back to the last block that has one.
"""

from __future__ import annotations

from collections import deque

from tessera.infer.config import EngineConfig
from tessera.infer.engine.sequence import Sequence
from tessera.infer.scheduling.kv_tier_planner import KVTierPlanner
from tessera.infer.scheduling.prefix_cache import PrefixCache, block_hash, hash_chain
from tessera.infer.scheduling.state_snapshots import StateSnapshots
from tessera.infer.scheduling.window_blocks import WindowPool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: KVTierPlanner | None = None, window: WindowPool | None = None,
                 snapshots: StateSnapshots | None = None):
        if window is not None and tiers is not None:
            raise ValueError("a windowed block pool goes without KV tiers (its slots are reused in turn)")
        self.window = window
        self.num_blocks = num_blocks
        self.tiers = tiers if enable_prefix_caching else None
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cache = PrefixCache() if enable_prefix_caching else None
        if window is not None:
            window.caching = self.cache is not None
        # a hybrid model's recurrent-state snapshots, which live and die with their blocks
        self.snapshots = snapshots if enable_prefix_caching else None

    # ---- counting --------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free ones and unreferenced cached ones (in each pool:
        the fewer of the two)."""
        return self._full_free if self.window is None else min(self._full_free, self.window.num_free_blocks)

    @property
    def _full_free(self) -> int:
        return len(self.free) + (len(self.cache.evictable) if self.cache is not None else 0)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.cache.pinned) if self.cache is not None else 0

    def forget_all(self) -> None:
        """Every block free and no prefix cached, keeping the cache's hit counts: the KV cache's
        contents are gone (an idle engine put to sleep, tessera/infer/engine/sleep.py)."""
        if any(self.ref[b] for b in range(self.num_blocks) if self.cache is None or b not in self.cache.pinned):
            raise RuntimeError("blocks are in use: only an idle engine's cache can be forgotten")
        self.ref = [0] * self.num_blocks
        self.free = deque(range(self.num_blocks))
        if self.cache is not None:
            self.cache.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.window is not None:
            self.window.forget_all()

    # ---- single blocks ---------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            evicted = self.cache.evict() if self.cache is not None else None
            if evicted is None:
                raise RuntimeError("KV cache out of blocks (the scheduler should have checked)")
            block = evicted[0]
            self._lose(block)
            if self.tiers is not None:
                self.tiers.evicted(*evicted)
        self.ref[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref[block] == 0 and self.cache is not None:
            self.cache.unpark(block)
        self.ref[block] += 1

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.cache is not None and self.cache.is_named(block):
                self.cache.park(block)
            else:
                self._lose(block)
                self.free.append(block)

    def _lose(self, block: int) -> None:
        """`block`'s contents are gone or will be overwritten: its state snapshot and its kept window
        block go with them."""
        if self.snapshots is not None:
            self.snapshots.drop(block)
        if self.window is not None:
            self.window.drop(block)

    def forget(self, block: int) -> None:
        """Drop `block`'s prefix-cache name (and its state snapshot): its contents are bad."""
        self.cache.forget(block)
        self._lose(block)

    # ---- sequences -------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks that hold the start of `seq` and their hashes. At least one token is
        left to compute, since the last prompt position must run to give the next token."""
        if self.cache is None or seq.block_table:
            return [], []
        limit = (len(seq.token_ids) - 1) // self.block_size
        hashes = hash_chain(seq.cache_token_ids, self.block_size, seq.adapter_key, limit=limit)
        return self._usable_prefix(self.cache.lookup(hashes)), hashes

    def _usable_prefix(self, blocks: list[int]) -> list[int]:
        """`blocks` cut back to the longest start that ends in a state snapshot (a hybrid sequence
        starts from one) and whose window blocks a query after it sees are all kept: each cut only
        shortens, so the cuts repeat until neither moves."""
        while True:
            cut = blocks
            if self.snapshots is not None:
                cut = self.snapshots.usable_prefix(cut)
            if self.window is not None:
                cut = self.window.usable_prefix(cut)
            if len(cut) == len(blocks):
                return cut
            blocks = cut

    def find_below(self, hashes: list[bytes], num_device: int) -> list:
        """Hits below the device (`KVTierPlanner.find`) for the blocks after the `num_device` found
        on it."""
        if self.tiers is None or num_device >= len(hashes):
            return []
        return self.tiers.find(hashes[num_device:])

    def can_allocate(self, num_blocks: int, reusing: list[int] = ()) -> bool:
        """Whether `num_blocks` new blocks fit while the cached blocks `reusing` get referenced (in a
        windowed pool: at most a ring's of them)."""
        parked = sum(1 for b in reusing if self.ref[b] == 0) if self.cache is not None else 0
        if self.window is not None:  # a new sequence takes at most a ring's fresh blocks, or one per block kept
            fresh = num_blocks if self.cache is not None else min(num_blocks, self.window.ring)
            if fresh > self.window.num_free_blocks - self.window.parked_in(list(reusing)):
                return False
        return num_blocks <= self._full_free - parked

    def adopt_prefix(self, seq: Sequence, blocks: list[int], hashes: list[bytes], below: list = ()) -> None:
        """Give `seq` the cached prefix `blocks`, then fresh blocks for the hits `below` the device
        (filled from their tier before the step's forward, and named): their tokens count as computed."""
        for b in blocks:
            self._acquire(b)
        seq.block_table = list(blocks)
        if self.window is not None:
            self.window.adopt(seq, seq.block_table)
        for hit, h in zip(below, hashes[len(blocks):]):
            block = self._take()
            self.tiers.bring_back(hit, block)
            self.cache.register(block, h)
            seq.block_table.append(block)
        found = len(seq.block_table)
        seq.block_hashes = list(hashes[:found])
        seq.num_computed = found * self.block_size
        if seq.prompt_cached is None:  # a preempted request's second admission finds its own blocks
            seq.prompt_cached = seq.num_computed
        if self.cache is not None:
            self.cache.record_query(len(hashes) * self.block_size, found * self.block_size)

    def ensure_slots(self, seq: Sequence, num_tokens: int, named: bool = True) -> bool:
        """Grow `seq.block_table` to hold `num_tokens` tokens; False (and nothing taken) if it cannot.
        `named`: whether its full blocks are to be named after the step (not for scoring, whose
        windowed blocks the ring then reuses as they come: window_blocks.py)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        window_need = self.window.need(seq, num_tokens, named) if self.window is not None else 0
        if need <= 0 and window_need <= 0:
            return True
        if need > self._full_free or (self.window is not None and window_need > self.window.num_free_blocks):
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        if self.window is not None:
            self.window.grow(seq, num_tokens, named)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Name every full block of `seq` whose tokens are all computed and final (with a windowed
        pool, keeping the window block of each with it); then give back the kept window blocks its
        ring turned away from that no later query of `seq` sees (parked, until evicted)."""
        if self.cache is not None:
            self._name_computed(seq)
        if self.window is not None:
            self.window.release_unseen(seq)

    def _name_computed(self, seq: Sequence) -> None:
        full = min(seq.num_computed, len(seq.token_ids)) // self.block_size
        bs, ids = self.block_size, seq.cache_token_ids
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            h = block_hash(parent, ids[i * bs:(i + 1) * bs], seq.adapter_key)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if not self.cache.register(block, h):  # named already by another block of the same tokens
                block = self.cache.block_of.get(h)
            if self.window is not None and block is not None:
                self.window.keep(seq, i, block)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references, last block first, so that a prompt's tail is evicted before
        its head (the head is the part other prompts are likeliest to share)."""
        if self.tiers is not None:  # written to disk (if there is one) while still named
            for b, h in zip(seq.block_table, seq.block_hashes):
                if self.cache.hash_of.get(b) == h:
                    self.tiers.persist(b, h)
        for b in reversed(seq.block_table):
            self._release(b)
        if self.window is not None:
            self.window.free_sequence(seq)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def pin_sequence(self, seq: Sequence) -> int:
        """Keep the named full blocks of `seq` cached for good; returns how many were pinned."""
        if self.cache is None:
            return 0
        pinned = 0
        for b in seq.block_table[:len(seq.block_hashes)]:
            if self.cache.is_named(b) and b not in self.cache.pinned:
                self._acquire(b)
                self.cache.pinned.add(b)
                pinned += 1
        return pinned

    def drop_cached(self) -> None:
        """Forget every unreferenced block the prefix cache names and free it: their contents are
        gone (the engine's KV cache was released) or stale (the weights changed)."""
        if self.cache is None:
            return
        for block in list(self.cache.evictable):
            self.forget(block)
            self.free.append(block)


def engine_blocks(geometry, config: EngineConfig, tiers: KVTierPlanner | None, prefix: bool,
                  snapshots: StateSnapshots | None = None) -> BlockManager:
    """The engine's block manager over `geometry` (runner/paged_model.py's `CacheGeometry`), with a
    windowed pool where `geometry.windowed` asks for one (KV tiers and disaggregation were refused
    with it); `prefix` is whether the model allows prefix caching at all (a hybrid's: with `snapshots`
    of its recurrent state)."""
    window = None
    if geometry.windowed is not None:
        window = WindowPool(geometry.num_window_blocks, config.block_size, geometry.windowed, config.lookahead)
    return BlockManager(geometry.num_blocks, config.block_size, prefix, tiers, window, snapshots)
