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

The scheduler plans (`KVTierPlanner`, beside the block manager), the executor moves the bytes
(`KVTierStore.apply`) at the start of the step: first every outgoing block is read (it may be
handed to another request in this same step), then incoming blocks are written. Host slots a plan
reads or writes are locked until the plan is taken, so one plan never reuses a slot it also reads.

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

import hashlib
import json
import os
import stat
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.config.errors import ConfigError
from tessera.infer.kv_cache import PagedKVCache

MAGIC = b"TSRAKV1\n"
MAX_HEADER = 1 << 16


@dataclass
class KVTransfers:
    """What the executor moves before a step's forward (device blocks, host slots)."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    to_disk: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, prefix hash)
    from_host: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    from_disk: list[tuple[list[torch.Tensor], int]] = field(default_factory=list)  # (contents, device block)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_disk or self.from_host or self.from_disk)


@dataclass
class TierMetrics:
    host_hit_blocks: int = 0  # blocks a prefix lookup found in host memory
    host_saved_blocks: int = 0  # evicted device blocks copied to host memory
    host_bytes: int = 0  # bytes moved between device and host memory, both ways
    disk_hit_blocks: int = 0
    disk_written_blocks: int = 0
    disk_rejected_files: int = 0  # files found but damaged, truncated or foreign: recomputed
    disk_bytes: int = 0  # bytes read and written
    seconds: float = 0.0  # time the executor spent moving blocks
    transfer_out_blocks: int = 0  # blocks a prefill instance sent (kv_transfer.py)
    transfer_in_blocks: int = 0  # blocks a decode instance received into its host tier
    transfer_rejected_blocks: int = 0  # received blocks that failed a check (the import stopped there)

    def prometheus_lines(self, p: str = "tessera") -> list[str]:
        rows = {
            "kv_host_hit_blocks_total": (self.host_hit_blocks, "Prefix blocks found in the host-memory tier."),
            "kv_host_saved_blocks_total": (self.host_saved_blocks, "Evicted device blocks kept in host memory."),
            "kv_host_bytes_total": (self.host_bytes, "Bytes moved between device and host tiers."),
            "kv_disk_hit_blocks_total": (self.disk_hit_blocks, "Prefix blocks found in the disk tier."),
            "kv_disk_written_blocks_total": (self.disk_written_blocks, "Blocks written to the disk tier."),
            "kv_disk_rejected_files_total": (self.disk_rejected_files,
                                             "Disk-tier files refused (damaged, truncated or foreign)."),
            "kv_disk_bytes_total": (self.disk_bytes, "Bytes read from and written to the disk tier."),
            "kv_tier_transfer_seconds_total": (self.seconds, "Time spent moving blocks between tiers."),
            "kv_transfer_out_blocks_total": (self.transfer_out_blocks, "Blocks sent to a decode instance."),
            "kv_transfer_in_blocks_total": (self.transfer_in_blocks, "Blocks received from a prefill instance."),
            "kv_transfer_rejected_blocks_total": (self.transfer_rejected_blocks,
                                                  "Received blocks that failed a check (recomputed)."),
        }
        out = []
        for name, (value, doc) in rows.items():
            out += [f"# HELP {p}_{name} {doc}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
        return out


# ---- identity and layout ---------------------------------------------------------------------
def block_layout(kv: PagedKVCache) -> list[tuple[str, int]]:
    """(dtype, elements) of each of a block's tensors, in `kv.stores()` order."""
    return [(str(s.dtype).removeprefix("torch."), s.view(kv.num_blocks, -1).shape[1]) for s in kv.stores()]


def block_bytes(kv: PagedKVCache) -> int:
    return sum(s.view(kv.num_blocks, -1).shape[1] * s.element_size() for s in kv.stores())


def model_identity(model: torch.nn.Module, kv: PagedKVCache, extra: str = "") -> str:
    """A name for the keys/values this model writes into this cache: its configuration, a strided
    sample of every weight, the cache's block size and tensor layout."""
    h = hashlib.blake2b(digest_size=20)
    cfg = getattr(model, "cfg", None)
    h.update(json.dumps(repr(cfg)).encode())
    h.update(json.dumps([kv.block_size, block_layout(kv), extra]).encode())
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 256)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(flat[::step][:256].float().cpu().numpy().tobytes())
    return h.hexdigest()


# ---- one block as bytes (disk files, transfers between instances) --------------------------------
def encode_block(identity: str, layout: list[tuple[str, int]], h: bytes, contents: list[torch.Tensor]) -> bytes:
    """MAGIC, a 4-byte header length, a JSON header (model identity, prefix hash, tensor layout,
    checksum of the payload), then the raw bytes of `contents` (CPU tensors, in layout order)."""
    payload = b"".join(c.contiguous().view(torch.uint8).numpy().tobytes() for c in contents)
    header = json.dumps({"identity": identity, "hash": h.hex(), "layout": [list(x) for x in layout],
                         "checksum": hashlib.blake2b(payload, digest_size=20).hexdigest()}).encode()
    return MAGIC + len(header).to_bytes(4, "little") + header + payload


def decode_block(data: bytes, identity: str, layout: list[tuple[str, int]], h: bytes) -> list[torch.Tensor] | None:
    """The tensors of an `encode_block` record, or None unless every check holds: the magic, a
    header that parses, this model's identity, the expected hash, this layout, the checksum and the
    exact length."""
    if data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        return None
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + n
    if n > MAX_HEADER or start > len(data):
        return None
    try:
        header = json.loads(data[len(MAGIC) + 4:start])
    except (ValueError, UnicodeDecodeError):
        return None
    payload = data[start:]
    if (not isinstance(header, dict) or header.get("identity") != identity or header.get("hash") != h.hex()
            or header.get("layout") != [list(x) for x in layout]
            or header.get("checksum") != hashlib.blake2b(payload, digest_size=20).hexdigest()):
        return None
    out, offset = [], 0
    for dtype, numel in layout:
        t = getattr(torch, dtype)
        size = numel * torch.empty((), dtype=t).element_size()
        if offset + size > len(payload):
            return None
        out.append(torch.frombuffer(bytearray(payload[offset:offset + size]), dtype=t))
        offset += size
    return out if offset == len(payload) else None


# ---- the host tier ---------------------------------------------------------------------------
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


class HostPool:
    """The host tier's bytes (executor side): per cache store, [slots, block elements]; pinned
    when the cache is on a CUDA device, so copies can run asynchronously."""

    def __init__(self, kv: PagedKVCache, num_slots: int):
        pin = kv.k[0].is_cuda
        self.stores = [torch.empty(num_slots, n, dtype=s.dtype, pin_memory=pin)
                       for s, (_, n) in zip(kv.stores(), block_layout(kv))]

    def write(self, slots: list[int], contents: list[torch.Tensor]) -> None:
        idx = torch.tensor(slots)
        for store, c in zip(self.stores, contents, strict=True):
            store.index_copy_(0, idx, c.to("cpu"))

    def read(self, slots: list[int]) -> list[torch.Tensor]:
        idx = torch.tensor(slots)
        return [store.index_select(0, idx) for store in self.stores]


def host_slots(kv: PagedKVCache, gib: float) -> int:
    return int(gib * 2**30) // block_bytes(kv)


# ---- the disk tier ---------------------------------------------------------------------------
def private_directory(path: str | Path) -> Path:
    """`path`, created 0700 if missing; refused when it is not a directory of this user that only
    this user can write (another user could plant files there)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"kv_cache_dir={str(path)!r} is invalid: not a directory (a symlink is refused)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(f"kv_cache_dir={str(path)!r} is invalid: it must belong to this user and be writable "
                          f"by this user only (mode {stat.S_IMODE(st.st_mode):o}; chmod 700 it)")
    return path


class DiskTier:
    """Blocks as files under a private directory, named by the model identity and prefix hash."""

    def __init__(self, path: str | Path, identity: str, layout: list[tuple[str, int]], max_bytes: int,
                 metrics: TierMetrics):
        self.root = private_directory(path)
        self.identity, self.layout, self.max_bytes, self.metrics = identity, layout, max_bytes, metrics
        self.written = 0  # bytes this process wrote since it last measured the directory
        self.known: set[bytes] = set()  # hashes this process wrote or read

    def path(self, h: bytes) -> Path:
        name = hashlib.blake2b(self.identity.encode() + h, digest_size=20).hexdigest()
        return self.root / name[:2] / f"{name}.kv"

    def contains(self, h: bytes) -> bool:
        return h in self.known or self.path(h).is_file()

    def read(self, h: bytes) -> list[torch.Tensor] | None:
        """The block's tensors (CPU), or None when there is no such file or it fails a check (the
        file is then removed)."""
        p = self.path(h)
        try:
            data = p.read_bytes()
        except OSError:
            return None
        contents = decode_block(data, self.identity, self.layout, h)
        if contents is None:
            self.metrics.disk_rejected_files += 1
            p.unlink(missing_ok=True)
            return None
        os.utime(p)  # most recently used
        self.known.add(h)
        self.metrics.disk_bytes += len(data)
        return contents

    def write(self, h: bytes, contents: list[torch.Tensor]) -> None:
        """Write the block atomically (a temporary file renamed), private to the user."""
        if self.path(h).is_file():
            return
        record = encode_block(self.identity, self.layout, h, contents)
        p = self.path(h)
        p.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(record)
        os.replace(tmp, p)
        self.known.add(h)
        self.metrics.disk_written_blocks += 1
        self.metrics.disk_bytes += len(record)
        self.written += len(record)
        if self.written > self.max_bytes // 10:
            self.trim()

    def trim(self) -> None:
        """Remove the least recently used files until the directory holds at most 90% of its bound."""
        self.written = 0
        files = []
        for p in self.root.glob("*/*.kv"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes * 0.9:
                break
            p.unlink(missing_ok=True)
            total -= size
        self.known = {h for h in self.known if self.path(h).is_file()}


# ---- the two sides ---------------------------------------------------------------------------
class KVTierPlanner:
    """The scheduler's side: which blocks go down a tier and which come back up, as a plan."""

    def __init__(self, host_slots: int, disk: DiskTier | None, metrics: TierMetrics):
        self.host = HostIndex(host_slots) if host_slots > 0 else None
        self.disk, self.metrics = disk, metrics
        self.pending = KVTransfers()
        self.planned: set[bytes] = set()  # hashes in pending.to_disk

    def evicted(self, block: int, h: bytes) -> None:
        """The device is about to reuse `block`, which holds `h`: keep a copy below it."""
        slot = self.host.reserve(h) if self.host is not None else None
        if slot is not None:
            self.pending.to_host.append((block, slot))
            self.metrics.host_saved_blocks += 1
        self.persist(block, h)

    def persist(self, block: int, h: bytes) -> None:
        """Write `block` (holding `h`) to disk, unless it is there or planned already."""
        if self.disk is not None and h not in self.planned and not self.disk.contains(h):
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

    def take(self) -> KVTransfers:
        out, self.pending = self.pending, KVTransfers()
        self.planned.clear()
        if self.host is not None:
            self.host.locked.clear()
        return out


class KVTierStore:
    """The executor's side: the host tier's bytes and the disk tier, and the copies a plan asks."""

    def __init__(self, kv: PagedKVCache, host: HostPool | None, disk: DiskTier | None, metrics: TierMetrics):
        self.kv, self.host, self.disk, self.metrics = kv, host, disk, metrics
        self.block_bytes = block_bytes(kv)

    def apply(self, t: KVTransfers) -> None:
        if not t:
            return
        t0 = time.perf_counter()
        out = sorted({b for b, _ in t.to_host} | {b for b, _ in t.to_disk})
        if out:
            contents = self.kv.read_blocks(out)
            row = {b: i for i, b in enumerate(out)}
            if t.to_host:
                rows = torch.tensor([row[b] for b, _ in t.to_host], device=contents[0].device)
                self.host.write([s for _, s in t.to_host], [c.index_select(0, rows) for c in contents])
                self.metrics.host_bytes += len(t.to_host) * self.block_bytes
            if t.to_disk:
                cpu = [c.cpu() for c in contents]
                for b, h in t.to_disk:
                    self.disk.write(h, [c[row[b]] for c in cpu])
        if t.from_host:
            self.kv.write_blocks([b for _, b in t.from_host], self.host.read([s for s, _ in t.from_host]))
            self.metrics.host_bytes += len(t.from_host) * self.block_bytes
        if t.from_disk:
            per_store = zip(*(contents for contents, _ in t.from_disk), strict=True)
            self.kv.write_blocks([b for _, b in t.from_disk], [torch.stack(parts) for parts in per_store])
        self.metrics.seconds += time.perf_counter() - t0


def build_tiers(model: torch.nn.Module, kv: PagedKVCache, offload_gib: float, cache_dir: str | None,
                cache_dir_gib: float, metrics: TierMetrics) -> tuple[KVTierPlanner, KVTierStore]:
    """The two sides of the tiers an engine config asks for, over `model`'s cache `kv`."""
    slots = host_slots(kv, offload_gib) if offload_gib else 0
    if offload_gib and slots < 1:
        raise ConfigError(f"kv_offload_gib={offload_gib} is invalid: it holds no block of "
                          f"{block_bytes(kv)} bytes; raise it")
    disk = None
    if cache_dir is not None:
        disk = DiskTier(cache_dir, model_identity(model, kv), block_layout(kv), int(cache_dir_gib * 2**30), metrics)
    host = HostPool(kv, slots) if slots else None
    return KVTierPlanner(slots, disk, metrics), KVTierStore(kv, host, disk, metrics)
