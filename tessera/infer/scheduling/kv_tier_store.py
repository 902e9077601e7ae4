"""The KV tiers' executor side: the bytes below the device cache (kv_tiers.py says how the tiers work).

A block as bytes (`encode_block` / `decode_block`: the disk tier's files, and the records that
kv_transfer.py sends between instances) named by the model's identity (`model_identity`); the host
tier's slots (`HostPool`); the disk tier (`DiskTier`, a private, bounded directory); and
`KVTierStore`, which makes the copies a plan (`KVTransfers`) asks at the start of a step.
`build_tier_store` is what an executor calls over its cache; the planner (kv_tier_planner.py) is
built over the store, sharing its disk tier and counters.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
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

log = logging.getLogger("tessera.kv")


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
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested too deeply to parse
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
RETRY_WRITES_S = 30.0  # after a write fails (a read-only or full file system) the tier only reads this long
_NO_WAIT = os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)  # opening a FIFO never blocks; a symlink is refused


def _shown(path: str) -> str:
    """`path` for a one-line message (a very long one shortened)."""
    return repr(path if len(path) <= 160 else path[:80] + "..." + path[-60:])


def private_directory(path: str | Path) -> Path:
    """`path`, created 0700 if missing. ConfigError (one line) when it cannot be created (a file is
    there, its parent is unwritable, it is too long), is not a directory of this user that only this
    user can write (another user could plant files there), or a block file cannot be written in it
    (a read-only or virtual file system such as /proc, a path too long for the files below it)."""
    path = Path(path)
    invalid = f"kv_cache_dir={_shown(str(path))} is invalid"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except FileExistsError:
        raise ConfigError(f"{invalid}: it exists and is not a directory") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in it
        raise ConfigError(f"{invalid}: it cannot be created ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{invalid}: not a directory (a symlink is refused)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(f"{invalid}: it must belong to this user and be writable by this user only "
                          f"(mode {stat.S_IMODE(st.st_mode):o}; chmod 700 it)")
    probe = path / "00" / f".{'0' * 40}.kv.{os.getpid()}.probe"  # as long as a block's temporary file
    try:
        probe.parent.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_WAIT, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{invalid}: a block file cannot be written in it ({e.strerror or e})") from None
    return path


def _discard(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink(missing_ok=True)


def _exists(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:  # a directory that cannot be searched any more
        return False


class DiskTier:
    """Blocks as files under a private directory, named by the model identity and prefix hash.

    An I/O failure while serving (the directory made read-only or removed, a full disk) never fails
    a request: the block is recomputed, or not written, the failure counted (`disk_errors`) and
    logged once until a write works again; after a failed write the tier only reads for
    RETRY_WRITES_S seconds (`writable`). Only regular files no larger than a block's record are read
    (a FIFO would block, a huge sparse file would fill memory); others are refused like a damaged
    file (`disk_rejected_files`)."""

    def __init__(self, path: str | Path, identity: str, layout: list[tuple[str, int]], max_bytes: int,
                 metrics: TierMetrics):
        self.root = private_directory(path)
        self.identity, self.layout, self.max_bytes, self.metrics = identity, layout, max_bytes, metrics
        self.max_record = len(MAGIC) + 4 + MAX_HEADER + sum(n * getattr(torch, d).itemsize for d, n in layout)
        self.written = 0  # bytes this process wrote since it last measured the directory
        self.known: set[bytes] = set()  # hashes this process wrote or read
        self.retry_writes_at = 0.0  # time.monotonic() from which writes are tried again
        self.failing = False  # a failure was logged and no write has worked since

    def path(self, h: bytes) -> Path:
        name = hashlib.blake2b(self.identity.encode() + h, digest_size=20).hexdigest()
        return self.root / name[:2] / f"{name}.kv"

    @property
    def writable(self) -> bool:
        return time.monotonic() >= self.retry_writes_at

    def contains(self, h: bytes) -> bool:
        return h in self.known or _exists(self.path(h))

    def _failed(self, doing: str, e: OSError) -> None:
        self.metrics.disk_errors += 1
        if not self.failing:
            self.failing = True
            log.warning("KV disk tier %s: %s failed (%s); requests go on without it (blocks recomputed or not "
                        "kept), counted in tessera_kv_disk_errors_total; said once until a write works again",
                        self.root, doing, e.strerror or e)

    def read(self, h: bytes) -> list[torch.Tensor] | None:
        """The block's tensors (CPU), or None when there is no such file, it cannot be read, or it
        fails a check (the file is then removed)."""
        p = self.path(h)
        try:
            data = self._read_file(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:  # a symlink is refused as a damaged file is; anything else is the tier's
                self._failed("reading a block", e)
                return None
            data = None
        contents = None if data is None else decode_block(data, self.identity, self.layout, h)
        if contents is None:
            self.metrics.disk_rejected_files += 1
            _discard(p)
            return None
        with contextlib.suppress(OSError):  # a read-only directory keeps its times
            os.utime(p)  # most recently used
        self.known.add(h)
        self.metrics.disk_bytes += len(data)
        return contents

    def _read_file(self, p: Path) -> bytes | None:
        """The bytes of block file `p`; None, unread, when it is not a regular file or is larger than
        a block's record."""
        fd = os.open(p, os.O_RDONLY | _NO_WAIT)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_record:
                return None
            chunks, size = [], 0
            while size <= self.max_record and (chunk := os.read(fd, self.max_record + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks) if size <= self.max_record else None  # it grew while read

    def write(self, h: bytes, contents: list[torch.Tensor]) -> None:
        """Write the block atomically (a temporary file renamed), private to the user; after a failure
        nothing is left behind."""
        p = self.path(h)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        if not self.writable or _exists(p):
            return
        record = encode_block(self.identity, self.layout, h, contents)
        try:
            p.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_WAIT, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, p)
        except OSError as e:
            self.retry_writes_at = time.monotonic() + RETRY_WRITES_S
            self._failed("writing a block", e)
            _discard(tmp)
            return
        if self.failing:
            self.failing = False
            log.warning("KV disk tier %s: writing works again", self.root)
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
        try:
            for p in self.root.glob("*/*.kv"):
                with contextlib.suppress(OSError):  # gone meanwhile
                    st = p.lstat()
                    files.append((st.st_mtime, st.st_size, p))
        except OSError as e:
            self._failed("listing the directory", e)
            return
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes * 0.9:
                break
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                self._failed("removing a block", e)
                break
            total -= size
        self.known = {h for h in self.known if _exists(self.path(h))}


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
