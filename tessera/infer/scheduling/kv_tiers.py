"""KV-cache tiers below the device pool: host memory (`--kv-offload-gib`) and a directory on disk
(`--kv-cache-dir`).

The device pool (`block_manager.py`) keeps full blocks named by their prefix hash chain
(`prefix_cache.py`) until it needs the space. With tiers on, a named block the device evicts is
first copied to the host tier (least recently used slot out first) and, with a cache directory,
written to disk; the named blocks of a request are written to disk when it finishes, so that a
server started later finds them. A prompt's prefix is looked up block by block, device first,
then host, then disk; the chain stops at the first block found nowhere. Blocks found below the
device get fresh device blocks and their contents are copied in before the step's forward, so the
tokens count as computed, exactly as for a device hit.

The scheduler plans (`kv_tier_planner.KVTierPlanner`, beside the block manager), the executor moves
the bytes (`kv_tier_store.KVTierStore.apply`) at the start of the step: first every outgoing block is
read (it may be handed to another request in this same step), then incoming blocks are written. Host
slots a plan reads or writes are locked until the plan is taken, so one plan never reuses a slot it
also reads. The executor builds its store over its own cache; the engine builds the planner over
that store (they share the disk tier and the counters). This module holds what both sides speak:
the plan (`KVTransfers`) and the counters (`TierMetrics`).

The disk tier is content-addressed: a block's file name is a hash of the model's identity (its
configuration, a sample of its weights, the cache's dtype and geometry) and of the block's prefix
hash. Each file is a small JSON header and the raw bytes of the block's tensors, with a checksum of
those bytes; nothing read is deserialized as code. A file that is damaged, truncated or made for
another model or geometry is a miss (the tokens are recomputed), never wrong keys. The directory
and its files are private to the user (0700 / 0600); several servers of one user may share it.
Its size is bounded (`--kv-cache-dir-gib`): past the bound the least recently used files go.

Both tiers serve one process (tensor_parallel_size 1): each rank of a tensor-parallel engine
would hold its own heads of every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class KVTransfers:
    """What the executor moves before a step's forward (device blocks, host slots)."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    to_disk: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, prefix hash)
    from_host: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    from_disk: list[tuple[list[torch.Tensor], int]] = field(default_factory=list)  # (contents, device block)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_disk or self.from_host or self.from_disk)


def _counter(metric: str, doc: str, default: float = 0):
    """A counter of `TierMetrics`: its value, and its name and help on /metrics (one place for each)."""
    return field(default=default, metadata={"metric": metric, "help": doc})


@dataclass
class TierMetrics:
    """The tiers' counters, kept by both sides (and by kv_transfer.py), exported on /metrics."""

    host_hit_blocks: int = _counter("kv_host_hit_blocks_total", "Prefix blocks found in the host-memory tier.")
    host_saved_blocks: int = _counter("kv_host_saved_blocks_total", "Evicted device blocks kept in host memory.")
    host_bytes: int = _counter("kv_host_bytes_total", "Bytes moved between device and host tiers.")  # both ways
    disk_hit_blocks: int = _counter("kv_disk_hit_blocks_total", "Prefix blocks found in the disk tier.")
    disk_written_blocks: int = _counter("kv_disk_written_blocks_total", "Blocks written to the disk tier.")
    disk_rejected_files: int = _counter("kv_disk_rejected_files_total",  # recomputed
                                        "Disk-tier files refused (damaged, truncated or foreign).")
    disk_bytes: int = _counter("kv_disk_bytes_total", "Bytes read from and written to the disk tier.")
    disk_errors: int = _counter("kv_disk_errors_total",  # the request went on without the disk tier
                                "Disk-tier reads and writes that failed (read-only or full file system).")
    seconds: float = _counter("kv_tier_transfer_seconds_total", "Time spent moving blocks between tiers.", 0.0)
    transfer_out_blocks: int = _counter("kv_transfer_out_blocks_total", "Blocks sent to a decode instance.")
    transfer_in_blocks: int = _counter("kv_transfer_in_blocks_total",  # into its host tier
                                       "Blocks received from a prefill instance.")
    transfer_rejected_blocks: int = _counter("kv_transfer_rejected_blocks_total",  # the import stopped there
                                             "Received blocks that failed a check (recomputed).")

    def prometheus_lines(self, p: str = "tessera") -> list[str]:
        out = []
        for f in fields(self):
            name, doc = f.metadata["metric"], f.metadata["help"]
            out += [f"# HELP {p}_{name} {doc}", f"# TYPE {p}_{name} counter", f"{p}_{name} {getattr(self, f.name)}"]
        return out
