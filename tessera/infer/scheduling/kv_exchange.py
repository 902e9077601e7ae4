"""What an engine offers another instance's KV blocks (`LLMEngine.kv_exchange`; kv_transfer.py uses it).

Prefill/decode disaggregation moves the KV blocks of a prompt's full prefix blocks from one engine
to another. What the message code needs of an engine is this, and no more: the model identity of
its cache (a block computed by another model, layout or block size is refused), the contents of
the device blocks a prefix hash chain names, room in its host tier for blocks received, and the
transfer counters. `KVExchange` answers those from the parts the engine owns (its executor's
cache and tier store, its block manager's prefix cache and tier planner), so kv_transfer.py never
reaches into them.
"""

from __future__ import annotations

import torch

from tessera.config.errors import ConfigError
from tessera.infer.runner.executor import Executor
from tessera.infer.scheduling.block_manager import BlockManager
from tessera.infer.scheduling.kv_tier_store import block_bytes, block_layout, model_identity
from tessera.infer.scheduling.kv_tiers import TierMetrics


class KVExchange:
    """One engine's KV blocks as another instance sees them: named by prefix hash, read out of the
    device cache, taken into the host tier."""

    def __init__(self, executor: Executor, blocks: BlockManager, metrics: TierMetrics):
        self._model, self._kv, self._store = executor.model, executor.local.kv, executor.kv_tiers
        self._cache, self._planner = blocks.cache, blocks.tiers
        self.block_size = blocks.block_size
        self.blocks_per_seq = executor.geometry.blocks_per_seq  # the most blocks one sequence holds
        self.max_model_len = executor.geometry.max_model_len
        self.metrics = metrics  # the transfer counters (transfer_out / in / rejected_blocks) among the tiers'
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        """The model identity of the cache (`model_identity`), computed once: it reads every weight."""
        if self._identity is None:
            self._identity = model_identity(self._model, self._kv)
        return self._identity

    @property
    def layout(self) -> list[tuple[str, int]]:
        """(dtype, elements) of each of a block's tensors (`block_layout`)."""
        return block_layout(self._kv)

    @property
    def block_bytes(self) -> int:
        return block_bytes(self._kv)

    def device_blocks(self, hashes: list[bytes]) -> list[list[torch.Tensor]]:
        """The contents of the leading blocks of the chain `hashes` that the device cache holds, in
        order: per block, one CPU tensor per cache store."""
        blocks = self._cache.lookup(hashes) if self._cache is not None else []
        if not blocks:
            return []
        contents = [c.cpu() for c in self._kv.read_blocks(blocks)]
        return [[c[i] for c in contents] for i in range(len(blocks))]

    def take_into_host(self, h: bytes, contents: list[torch.Tensor]) -> bool:
        """Keep one block's `contents` (one CPU tensor per cache store) in the host tier under prefix
        hash `h`, where a later prompt finds it; nothing to write when the tier holds `h` already.
        False when every host slot is in use by the plan being built."""
        if self._planner is None or not self._planner.has_host:
            raise ConfigError("this engine has no host tier to take KV blocks into; give kv_offload_gib > 0")
        if self._planner.holds(h):
            return True
        slot = self._planner.reserve_host(h)
        if slot is None:
            return False
        self._store.write_host(slot, contents)
        return True
