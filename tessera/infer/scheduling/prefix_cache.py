"""Prefix KV-cache reuse: full blocks found again by the hash chain of the tokens that led to them.

Block i of a sequence is named by h_i = H(h_{i-1} || adapter || tokens of block i), so two
prompts share block i exactly when their first (i+1) * block_size tokens and their LoRA adapter
are equal: the keys/values in it are then the same. Only full blocks whose tokens are final are
named. A named block whose last user left is not freed but kept, least-recently-used first in
line for eviction, until a new allocation needs the space. System prompts computed at start are
pinned: they keep a reference of their own and are never evicted.

Hit rate counts tokens: of the prompt tokens that could have come from the cache (the full
blocks of each prompt looked up), how many did.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def block_hash(parent: bytes, tokens: Sequence[int], adapter_key: bytes = b"") -> bytes:
    """The name of a full block: blake2b over the parent's name, the adapter and the token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(len(adapter_key).to_bytes(2, "little"))
    h.update(adapter_key)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def hash_chain(tokens: Sequence[int], block_size: int, adapter_key: bytes = b"", start: int = 0,
               parent: bytes = b"", limit: int | None = None) -> list[bytes]:
    """Names of the full blocks of `tokens` from block index `start` (whose parent is `parent`),
    at most up to block index `limit` (exclusive)."""
    n_full = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    out = []
    for i in range(start, n_full):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], adapter_key)
        out.append(parent)
    return out


class PrefixCache:
    """hash -> block table, plus the LRU order of the named blocks nobody references."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.pinned: set[int] = set()
        self.queried_tokens = 0
        self.hit_tokens = 0

    def clear(self) -> None:
        """Forget every block (pinned ones too), keeping the hit counts."""
        self.block_of.clear()
        self.hash_of.clear()
        self.evictable.clear()
        self.pinned.clear()

    def __len__(self) -> int:
        return len(self.block_of)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`."""
        blocks = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def register(self, block: int, h: bytes) -> bool:
        """Name `block` by `h`; False when another block already holds that content."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h] = block
        self.hash_of[block] = h
        return True

    def is_named(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        """`block` lost its last reference: keep it, most recently used."""
        self.evictable[block] = None
        self.evictable.move_to_end(block)

    def unpark(self, block: int) -> None:
        """`block` is referenced again."""
        self.evictable.pop(block, None)

    def forget(self, block: int) -> None:
        """Drop `block`'s name: its contents are bad and must never be found by a lookup."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
        self.evictable.pop(block, None)

    def evict(self) -> tuple[int, bytes] | None:
        """Forget the least recently used unreferenced block; it and the name it had (None if there
        is none)."""
        if not self.evictable:
            return None
        block, _ = self.evictable.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.block_of[h]
        return block, h
