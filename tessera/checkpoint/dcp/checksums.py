"""Checksums of a checkpoint's files, so that a truncated or corrupted checkpoint is detected.

Every file of a DCP checkpoint (the `__R_N.distcp` shards and `.metadata`) is recorded in its
meta.json as `"files": {name: {"bytes": size, "crc32": hex}}`. CRC-32 (zlib) detects what
happens to files by accident (a write cut short, flipped bits, a lost shard) at about twice the
speed of SHA-256 on one core; it is no defence against someone who can rewrite meta.json too,
which is why loading never trusts the files' content either (reader.py). Each rank hashes the shards it
wrote itself (their names start with `__R_`), rank 0 gathers them and adds `.metadata`; meta.json
is written after that and before the `latest` pointer moves. `verify_files` re-reads them and
names the first file that is missing, has another size (a write cut short) or another digest
(flipped bits).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

FILES_KEY = "files"
DCP_METADATA = ".metadata"  # DCP's own metadata file, recorded by rank 0
_CHUNK = 1 << 22


def file_digest(path: Path) -> dict[str, int | str]:
    """{"bytes": size, "crc32": 8 hex digits} of one file."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": os.path.getsize(path), "crc32": f"{crc:08x}"}


def digest_rank_files(directory: Path, rank: int) -> dict[str, dict[str, int | str]]:
    """Digests of the DCP shard files rank `rank` wrote into `directory`."""
    prefix = f"__{rank}_"
    return {p.name: file_digest(p) for p in sorted(directory.iterdir())
            if p.name.startswith(prefix) and p.is_file()}


def verify_files(directory: Path, files: dict) -> str | None:
    """None when every recorded file is there with its size and digest; else what is wrong, naming
    the file. The sizes are checked for all files before any file is read."""
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return f"its meta.json has a malformed {FILES_KEY!r} entry"
    for name, want in sorted(files.items()):
        p = directory / name
        if "/" in name or name in (".", "..") or not p.is_file() or p.is_symlink():
            return f"file {name} is missing"
        size = p.stat().st_size
        if size != want.get("bytes"):
            return f"file {name} has {size} bytes, {want.get('bytes')} were written (truncated or overwritten)"
    for name, want in sorted(files.items()):
        if file_digest(directory / name)["crc32"] != want.get("crc32"):
            return f"file {name} does not match its crc32 checksum (corrupted)"
    return None
