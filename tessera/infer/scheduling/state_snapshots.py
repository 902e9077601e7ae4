"""Prefix caching for hybrid models: snapshots of the recurrent state at block boundaries.

A linear-attention layer's state after a prompt prefix cannot be rebuilt from that prefix's KV
blocks, so a prefix hit alone does not let a hybrid sequence skip the prefix. The engine therefore
keeps, beside a named KV block, a snapshot of the recurrent state (every state the pool holds per
recurrent layer: for Gated DeltaNet the convolution window and the delta state, for Mamba-2 the
convolution window and the SSD state) after that block's last token, every `snapshot_tokens` tokens (a
whole number of blocks: by default the chunked form's chunk, `states.chunk_tokens`, where a prompt's
work is cut anyway). A request whose prompt starts with cached blocks
adopts them only up to the last one that has a snapshot (`usable_prefix`), and its slot starts from
that snapshot instead of zero.

`StateSnapshots` is the driver's table, shared by the block manager and the model runner: snapshot k
lives in the state pool after the running slots (`RecurrentStatePool.snapshot_index`). The runner
takes a free snapshot for each block boundary an item's final tokens cross whose block has none yet
(`plan_item`), and the step writes the state there at that boundary (recurrent_step.py). A snapshot
lives as long as its block's KV: the block manager gives it back when the block is evicted, forgotten,
or freed without a name (`drop`). How many snapshots there are is paid out of the KV budget
(`snapshot_count`); when none is free a boundary simply gets none, and its block is then not an end
of a usable prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


def snapshot_tokens(block_size: int, chunk_size: int, configured: int | None) -> int:
    """Tokens between snapshots: `configured` (EngineConfig.state_snapshot_tokens), or the chunked
    form's chunk rounded up to whole blocks, so that cutting a prompt at a snapshot adds no padded
    chunk to the work (delta_rule.py pads each call to whole chunks)."""
    return configured or block_size * -(-chunk_size // block_size)


def snapshot_count(budget: int, per_snapshot: int, most: int) -> int:
    """Snapshots for a KV budget of `budget` bytes: up to half of it (the rest holds the attention
    blocks), at most `most` (one per block a full batch of sequences can hold)."""
    if per_snapshot <= 0 or budget <= 0:
        return 0
    return min(budget // 2 // per_snapshot, most)


class StateSnapshots:
    """Block -> its snapshot (module docstring); `block_size`: tokens per KV block; `every`: tokens
    between snapshots (a multiple of it: `snapshot_tokens`)."""

    def __init__(self, num_snapshots: int, block_size: int, every: int | None = None):
        self.num_snapshots, self.block_size, self.every = num_snapshots, block_size, every or block_size
        self.free = list(range(num_snapshots - 1, -1, -1))
        self.of_block: dict[int, int] = {}
        self.taken = 0  # snapshots written, over the engine's life

    def has(self, block: int) -> bool:
        return block in self.of_block

    def usable_prefix(self, blocks: list[int]) -> list[int]:
        """The longest start of the cached `blocks` whose last block has a snapshot."""
        n = len(blocks)
        while n and blocks[n - 1] not in self.of_block:
            n -= 1
        return blocks[:n]

    def restore_from(self, block_table: Sequence[int], start: int) -> int:
        """The snapshot a sequence adopted at `start` (a block boundary) starts its slot from."""
        block = block_table[start // self.block_size - 1]
        if start % self.block_size or block not in self.of_block:
            raise RuntimeError(f"no recurrent-state snapshot at position {start} (block {block}): a hybrid "
                               "sequence can only adopt a cached prefix that ends in one")
        return self.of_block[block]

    def plan_item(self, block_table: Sequence[int], start: int, length: int) -> tuple[tuple[int, int], ...]:
        """(offset in the item, snapshot) for each snapshot boundary (every `every` tokens) its tokens
        [start, start + length) end at whose block has no snapshot yet, while free snapshots last."""
        out = []
        bs, every = self.block_size, self.every
        for end in range(-(-(start + 1) // every) * every, start + length + 1, every):
            block = block_table[end // bs - 1]
            if block in self.of_block or not self.free:
                continue
            self.of_block[block] = k = self.free.pop()
            self.taken += 1
            out.append((end - start, k))
        return tuple(out)

    def drop(self, block: int) -> None:
        """`block`'s KV is gone (evicted, forgotten, freed unnamed): so is its snapshot."""
        k = self.of_block.pop(block, None)
        if k is not None:
            self.free.append(k)

    def clear(self) -> None:
        """Every snapshot free: the KV cache's contents are gone."""
        self.of_block.clear()
        self.free = list(range(self.num_snapshots - 1, -1, -1))
