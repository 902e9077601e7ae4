"""A GGUF file's header and metadata walked with every count bounded by the file's own size, before
gguf's reader (or transformers, which uses it) walks them.

gguf's `GGUFReader` believes the counts a file declares: an array of 10^9 items in a 100-byte file
is 10^9 turns of a Python loop, and every item it does read costs it ~1.4 KB of memory (a million
strings: about two minutes and 1.4 GB). So the file is walked here first, cheaply (struct over a
read-only memory map, nothing kept but scalars), and refused with one ConfigError naming the key
when a count cannot be true:

- an array of n items of a fixed-size type needs n * size bytes left in the file, an array of
  strings at least 8 bytes per item (each string's length), a string its length;
- the numbers of metadata entries and of tensors, at least the smallest entry's bytes each;
- an array holds at most MAX_ARRAY_ITEMS items (four times the largest vocabulary or merge list
  of a released model), arrays nest at most MAX_ARRAY_DEPTH deep, a tensor has at most 4 dims;
- every `tokenizer.ggml.*_token_id` names a token of `tokenizer.ggml.tokens`.

Layout (GGUF versions 2 and 3, little- or big-endian as the version field shows): magic, u32
version, u64 tensor count, u64 metadata count; each metadata entry a string key, a u32 value type
and the value (an array: u32 item type, u64 count, the items); a string is a u64 length and its
bytes; then each tensor's name, u32 dims, u64 per dim, u32 type and u64 offset.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from tessera.config.errors import ConfigError

VERSIONS = (2, 3)
MAX_ARRAY_ITEMS = 1 << 20  # the largest real ones: 262,144 tokens (Gemma 3), ~450,000 merges (o200k)
MAX_ARRAY_DEPTH = 2  # an array of arrays; GGUF writers use none deeper
MAX_DIMS = 4  # GGML_MAX_DIMS
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of a scalar of that type (gguf-py's GGUFValueType)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SMALLEST_ENTRY = 8 + 4 + 1  # a metadata entry: an empty key, its type, a one-byte value
_SMALLEST_TENSOR = 8 + 4 + 4 + 8  # a tensor: an empty name, no dims, its type and offset


@dataclass
class GGUFMetadata:
    """What the walk keeps: each scalar metadata value (numbers and booleans) and each array's length."""

    scalars: dict[str, int | float | bool] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)


class _Walk:
    """A cursor over the file's bytes that never moves past its end (ConfigError naming `what` instead)."""

    def __init__(self, buf, path: Path, order: str):
        self.buf, self.path, self.pos = buf, path, 0
        self.formats = {c: struct.Struct(order + c) for c in "BbHhIiQqfd?"}

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{str(self.path)!r}: {message}; it may be truncated or damaged (or made to exhaust memory)")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes, but only {self.left()} are left in the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def number(self, fmt: str, what: str):
        s = self.formats[fmt]
        return s.unpack_from(self.buf, self.take(s.size, what))[0]

    def strings(self, n: int, what: str) -> None:
        """Step over `n` strings (a token list: a tight loop, ~0.3 s a million)."""
        self.count(n, 8, what)
        length, buf, pos, end = self.formats["Q"], self.buf, self.pos, len(self.buf)
        for _ in range(n):
            if pos + 8 > end:
                break
            pos += 8 + length.unpack_from(buf, pos)[0]
            if pos > end:
                break
        else:
            self.pos = pos
            return
        raise self.fail(f"{what} holds strings that run past the end of the file")

    def string(self, what: str) -> bytes:
        n = self.number("Q", what)
        start = self.take(n, f"{what} (a string of {n} bytes)")
        return self.buf[start:start + n]

    def count(self, n: int, least: int, what: str) -> None:
        """`n` items of at least `least` bytes each must fit in what is left of the file."""
        if n * least > self.left():
            raise self.fail(f"{what} declares {n:,} items of at least {least} bytes each, more than the "
                            f"{self.left():,} bytes left in the file")


def _value(w: _Walk, kind: int, key: str, meta: GGUFMetadata, depth: int = 0) -> None:
    what = f"GGUF metadata {key!r}"
    if kind in _SCALARS:
        value = w.number(_SCALARS[kind], what)
        if depth == 0:
            meta.scalars[key] = value
    elif kind == _STRING:
        w.take(w.number("Q", what), f"{what} (a string)")
    elif kind == _ARRAY:
        item, n = w.number("I", what), w.number("Q", what)
        if depth == 0:
            meta.array_lengths[key] = n
        if n > MAX_ARRAY_ITEMS:
            raise w.fail(f"{what} declares {n:,} array items; Tessera reads at most {MAX_ARRAY_ITEMS:,}")
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            w.count(n, size, what)
            w.take(n * size, what)
        elif item == _STRING:
            w.strings(n, what)
        elif item == _ARRAY:
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise w.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            w.count(n, 12, what)
            for _ in range(n):
                _value(w, _ARRAY, key, meta, depth + 1)
        else:
            raise w.fail(f"{what} is an array of value type {item}, which GGUF does not define")
    else:
        raise w.fail(f"{what} has value type {kind}, which GGUF does not define")


def _tensor_infos(w: _Walk, count: int) -> None:
    w.count(count, _SMALLEST_TENSOR, "the GGUF header's tensor count")
    for i in range(count):
        what = f"GGUF tensor #{i}"
        w.string(what)
        dims = w.number("I", what)
        if dims > MAX_DIMS:
            raise w.fail(f"{what} declares {dims} dimensions; GGML tensors have at most {MAX_DIMS}")
        w.take(8 * dims + 4 + 8, what)


def read_metadata(path: str | os.PathLike) -> GGUFMetadata:
    """Walk GGUF file `path`'s header, metadata and tensor list within its size; ConfigError naming
    the first count the file cannot hold."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if f.read(4) != b"GGUF":
                raise ConfigError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")
            if size < 24:
                raise ConfigError(f"{str(path)!r} is not a readable GGUF file ({size} bytes, shorter than GGUF's "
                                  "header); it may be truncated or damaged")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(buf, path)
    except OSError as e:
        raise ConfigError(f"GGUF file {str(path)!r} cannot be read ({e.strerror or e})") from None


def _walk(buf, path: Path) -> GGUFMetadata:
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian machine (gguf's reader reads those too)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    w = _Walk(buf, path, order)
    if version not in VERSIONS:
        raise w.fail(f"GGUF version {version} is not read (versions {' and '.join(map(str, VERSIONS))} are)")
    w.pos = 8
    tensors, entries = w.number("Q", "the GGUF header"), w.number("Q", "the GGUF header")
    w.count(entries, _SMALLEST_ENTRY, "the GGUF header's metadata count")
    meta = GGUFMetadata()
    for _ in range(entries):
        key = w.string("a GGUF metadata key").decode("utf-8", "replace")
        _value(w, w.number("I", f"GGUF metadata {key!r}"), key, meta)
    _tensor_infos(w, tensors)
    _check_token_ids(w, meta)
    return meta


def _check_token_ids(w: _Walk, meta: GGUFMetadata) -> None:
    """Every special token id the tokenizer metadata names is a token of its list."""
    n = meta.array_lengths.get("tokenizer.ggml.tokens")
    if n is None:
        return
    for key, value in meta.scalars.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not (
                isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n):
            raise ConfigError(f"{str(w.path)!r}: GGUF metadata {key!r} is {value!r}, outside the vocabulary of {n} "
                              "tokens (tokenizer.ggml.tokens); the file's tokenizer is not this model's")
