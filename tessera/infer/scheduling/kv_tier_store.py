"""The KV tiers' executor side: the bytes below the device cache (kv_tiers.py says how the tiers work).

A block as bytes (`encode_block` / `decode_block`: the disk tier's files, and the records that
kv_transfer.py sends between instances) named by the model's identity (`model_identity`); the host
tier's slots (`HostPool`); the disk tier (`DiskTier`, a private, bounded directory); and
`KVTierStore`, which makes the copies a plan (`KVTransfers`) asks at the start of a step.
`build_tier_store` is what an executor calls over its cache; the planner (kv_tier_planner.py) is
built over the store, sharing its disk tier and counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

import torch

from tessera.config.errors import ConfigError
from tessera.infer.scheduling.kv_cache import PagedKVCache
from tessera.infer.scheduling.kv_tiers import KVTransfers, TierMetrics

MAGIC = b"TSRAKV1\n"
MAX_HEADER = 1 << 16


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
class HostPool:
    """The host tier's bytes (executor side): per cache store, [slots, block elements]; pinned
    when the cache is on a CUDA device, so copies can run asynchronously."""

    def __init__(self, kv: PagedKVCache, num_slots: int):
        pin = kv.k[0].is_cuda
        self.num_slots = num_slots
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


# ---- the store -------------------------------------------------------------------------------
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

    def write_host(self, slot: int, contents: list[torch.Tensor]) -> None:
        """Put one block's `contents` (one tensor per cache store, as `decode_block` gives them) into
        host slot `slot`, which the planner reserved (blocks received from another instance)."""
        self.host.write([slot], [c[None] for c in contents])


def build_tier_store(model: torch.nn.Module, kv: PagedKVCache, offload_gib: float, cache_dir: str | None,
                     cache_dir_gib: float) -> KVTierStore:
    """The tiers an engine config asks for (`kv_offload_gib`, `kv_cache_dir`, `kv_cache_dir_gib`) below
    `model`'s cache `kv`, with fresh counters."""
    slots = host_slots(kv, offload_gib) if offload_gib else 0
    if offload_gib and slots < 1:
        raise ConfigError(f"kv_offload_gib={offload_gib} is invalid: it holds no block of "
                          f"{block_bytes(kv)} bytes; raise it")
    metrics = TierMetrics()
    disk = None
    if cache_dir is not None:
        disk = DiskTier(cache_dir, model_identity(model, kv), block_layout(kv), int(cache_dir_gib * 2**30), metrics)
    host = HostPool(kv, slots) if slots else None
    return KVTierStore(kv, host, disk, metrics)
