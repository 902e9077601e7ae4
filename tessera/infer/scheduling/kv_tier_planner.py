"""The KV tiers' scheduler side: which blocks go down a tier and which come back up (kv_tiers.py
says how the tiers work).

`HostIndex` names the host tier's slots by prefix hash, least recently used first; `KVTierPlanner`
is what the block manager calls when the device evicts a named block, looks a prefix up below the
device, or brings a block back, and collects those decisions as the step's plan (`KVTransfers`),
which the executor's store (kv_tier_store.py) carries out. The planner is built over that store
(`KVTierPlanner.over`): it uses the store's host slots by number, reads the disk tier the store
writes, and counts into the same `TierMetrics`.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from tessera.infer.scheduling.kv_tier_store import DiskTier, KVTierStore
from tessera.infer.scheduling.kv_tiers import KVTransfers, TierMetrics


class HostIndex:
    """prefix hash -> host slot, least recently used first (scheduler side)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.hash_of: dict[int, bytes] = {}
        self.free: deque[int] = deque(range(num_slots))
        self.locked: set[int] = set()

    def get(self, h: bytes) -> int | None:
        """The slot holding `h`, marked used (and locked until the plan is taken); None if absent."""
        slot = self.slot_of.get(h)
        if slot is not None:
            self.slot_of.move_to_end(h)
            self.locked.add(slot)
        return slot

    def reserve(self, h: bytes) -> int | None:
        """A slot for `h`'s contents (the oldest unlocked one when none is free), locked; None when
        `h` is held already or every slot is locked."""
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return None
        if self.free:
            slot = self.free.popleft()
        else:
            old = next((k for k, s in self.slot_of.items() if s not in self.locked), None)
            if old is None:
                return None
            slot = self.slot_of.pop(old)
            del self.hash_of[slot]
        self.slot_of[h], self.hash_of[slot] = slot, h
        self.locked.add(slot)
        return slot


class KVTierPlanner:
    """The scheduler's side: which blocks go down a tier and which come back up, as a plan."""

    def __init__(self, host_slots: int, disk: DiskTier | None, metrics: TierMetrics):
        self.host = HostIndex(host_slots) if host_slots > 0 else None
        self.disk, self.metrics = disk, metrics
        self.pending = KVTransfers()
        self.planned: set[bytes] = set()  # hashes in pending.to_disk

    @classmethod
    def over(cls, store: KVTierStore) -> KVTierPlanner:
        """The planner of `store`'s tiers: as many host slots as it holds, its disk tier, its counters."""
        return cls(store.host.num_slots if store.host is not None else 0, store.disk, store.metrics)

    def evicted(self, block: int, h: bytes) -> None:
        """The device is about to reuse `block`, which holds `h`: keep a copy below it."""
        slot = self.host.reserve(h) if self.host is not None else None
        if slot is not None:
            self.pending.to_host.append((block, slot))
            self.metrics.host_saved_blocks += 1
        self.persist(block, h)

    def persist(self, block: int, h: bytes) -> None:
        """Write `block` (holding `h`) to disk, unless it is there or planned already, or writes to
        the disk tier are paused after a failure."""
        if self.disk is not None and self.disk.writable and h not in self.planned and not self.disk.contains(h):
            self.planned.add(h)
            self.pending.to_disk.append((block, h))

    def find(self, hashes: list[bytes]) -> list[int | list[torch.Tensor]]:
        """Below-device hits for the leading `hashes`: a host slot or a disk block's contents each,
        stopping at the first miss."""
        found: list[int | list[torch.Tensor]] = []
        for h in hashes:
            slot = self.host.get(h) if self.host is not None else None
            if slot is not None:
                found.append(slot)
                continue
            contents = self.disk.read(h) if self.disk is not None else None
            if contents is None:
                break
            found.append(contents)
        return found

    def bring_back(self, hit: int | list[torch.Tensor], block: int) -> None:
        if isinstance(hit, int):
            self.pending.from_host.append((hit, block))
            self.metrics.host_hit_blocks += 1
        else:
            self.pending.from_disk.append((hit, block))
            self.metrics.disk_hit_blocks += 1

    @property
    def has_host(self) -> bool:
        return self.host is not None

    def holds(self, h: bytes) -> bool:
        """Whether the host tier holds `h` (neither marked used nor locked)."""
        return self.host is not None and h in self.host.slot_of

    def reserve_host(self, h: bytes) -> int | None:
        """A host slot for `h`, which the host tier does not hold (`HostIndex.reserve`), for contents
        written outside a plan (blocks received from another instance); None when every slot is locked."""
        return self.host.reserve(h)

    def take(self) -> KVTransfers:
        out, self.pending = self.pending, KVTransfers()
        self.planned.clear()
        if self.host is not None:
            self.host.locked.clear()
        return out
