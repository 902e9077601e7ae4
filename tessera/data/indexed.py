"""Memory-mapped indexed dataset: a `.bin` of raw token ids and an `.idx` of document offsets.

A dataset at prefix `P` is two files:

- `P.bin`: every document's token ids, concatenated, as little-endian unsigned integers
  (`uint16` while the vocabulary fits, else `uint32`; `uint8` for loss masks).
- `P.idx`: a 24-byte header, then `num_documents + 1` little-endian int64 token offsets, so
  document `d` is `tokens[offsets[d]:offsets[d + 1]]`.

      bytes 0-7    magic  b"TSRIDX\\x00\\x00"
      bytes 8-11   uint32 format version (1)
      bytes 12-15  uint32 dtype code (1 = uint8, 2 = uint16, 3 = uint32)
      bytes 16-23  uint64 number of documents
      bytes 24-    int64  offsets[num_documents + 1], offsets[0] = 0, non-decreasing

Both files are read with `np.memmap`, so opening a dataset of any size costs nothing and the
operating system pages tokens in as samples touch them. Opening validates both files against
each other: a missing file, a foreign file, or a `.bin` whose size does not match the index (a
truncated copy, say) raises `DataError` naming the file and the expected and actual sizes.
`check_token_ids(vocab_size)` scans the ids themselves (the trainer calls it on every dataset
before the first step).

The writer streams tokens to temporary files next to the targets and renames them into place
only when done (`.bin` first, `.idx` last), so an interrupted run never damages an existing
dataset and a dataset whose `.idx` exists is complete.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tessera.config.errors import DataError
from tessera.data.atomic_write import commit, discard, temporary_sibling

MAGIC = b"TSRIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, number of documents
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 3: np.dtype(np.uint32)}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
CHECK_CHUNK_TOKENS = 1 << 24  # ids scanned at a time by `check_token_ids` (32-64 MiB of memory)


def index_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """The `(.bin, .idx)` paths of the dataset at `prefix` (the suffixes are appended, not swapped)."""
    prefix = os.fspath(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds every id below `vocab_size`: uint16 up to 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _check_dtype(dtype: np.dtype | type | str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF:
        allowed = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise DataError(f"indexed dataset dtype {dtype} is not supported; allowed: {allowed}")
    return dtype


class IndexedDatasetWriter:
    """Append documents of token ids, then `finalize()` to publish `prefix.bin` and `prefix.idx`.

    Use as a context manager: leaving the block normally finalizes, leaving it by an exception
    removes the temporary files and leaves whatever was at `prefix` untouched.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type | str):
        self.dtype = _check_dtype(dtype)
        self.bin_path, self.idx_path = index_paths(prefix)
        self._limit = int(np.iinfo(self.dtype).max)
        self._offsets: list[int] = [0]
        self._tmp_bin = self._tmp_idx = None
        try:
            self._tmp_bin = temporary_sibling(self.bin_path)
            self._tmp_idx = temporary_sibling(self.idx_path)
            self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed by finalize/abort
        except OSError as e:  # an unwritable or full destination
            for tmp in (self._tmp_bin, self._tmp_idx):
                if tmp is not None:
                    discard(tmp)
            raise self._cannot_write(e) from None
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (possibly empty). Ids must fit the writer's dtype."""
        if self._done:
            raise DataError(f"{self.bin_path}: writer already finalized; open a new one to write more")
        array = np.asarray(tokens)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise DataError(f"{self.bin_path}: a document must be a 1-D sequence of integer ids, "
                            f"got shape {array.shape} dtype {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high > self._limit:
                bad = low if low < 0 else high
                raise DataError(f"{self.bin_path}: token id {bad} does not fit {self.dtype} "
                                f"(allowed 0..{self._limit}); write with a wider dtype")
        try:
            self._bin.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        except OSError as e:
            self.abort()
            raise self._cannot_write(e) from None
        self._offsets.append(self._offsets[-1] + int(array.size))

    def finalize(self) -> None:
        """Write the index and rename both files into place (the `.idx` last)."""
        if self._done:
            return
        try:
            self._bin.close()
            with open(self._tmp_idx, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], self.num_documents))
                f.write(np.asarray(self._offsets, dtype="<i8").tobytes())
            commit(self._tmp_bin, self.bin_path)
            commit(self._tmp_idx, self.idx_path)
        except OSError as e:
            self.abort()
            raise self._cannot_write(e) from None
        except BaseException:
            self.abort()
            raise
        self._done = True

    def _cannot_write(self, error: OSError) -> DataError:
        return DataError(f"dataset {str(self.bin_path.with_suffix(''))!r} cannot be written: "
                         f"{error.strerror or error}; nothing was written there (free space, or write it elsewhere)")

    def abort(self) -> None:
        """Drop everything written so far; files already at the prefix stay as they were."""
        try:
            self._bin.close()
        except OSError:  # flushing what was buffered fails again on a full disk: it is dropped anyway
            pass
        discard(self._tmp_bin)
        discard(self._tmp_idx)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of the dataset at `prefix`: documents by index, or any span of the stream.

    `ds[d]` is document `d`; `ds.get(offset, length)` reads `length` tokens of the concatenated
    stream starting at token `offset`, across document boundaries. Both return views into the
    memory map (copy them before modifying).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = index_paths(prefix)
        self.dtype, self.offsets = self._read_index()
        self.tokens = self._map_tokens()

    def _read_index(self) -> tuple[np.dtype, np.ndarray]:
        path = self.idx_path
        if not path.is_file():
            raise DataError(f"{path}: index file is missing (an indexed dataset needs both "
                            f"{self.bin_path.name} and {path.name}); build it with `tessera preprocess`")
        size = path.stat().st_size
        if size < _HEADER.size:
            raise DataError(f"{path}: truncated index: {size} bytes, expected at least {_HEADER.size}")
        with open(path, "rb") as f:
            magic, version, code, num_documents = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{path}: not a Tessera index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{path}: index format version {version} is not supported (allowed: {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} (allowed: {sorted(DTYPE_CODES)})")
        expected = _HEADER.size + 8 * (num_documents + 1)
        if size != expected:
            raise DataError(f"{path}: index size {size} bytes does not match its header: expected "
                            f"{expected} bytes for {num_documents} documents (truncated or corrupt)")
        offsets = np.memmap(path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(num_documents + 1,))
        if offsets[0] != 0 or (num_documents and bool(np.any(np.diff(offsets) < 0))):
            raise DataError(f"{path}: document offsets must start at 0 and never decrease (corrupt index)")
        return DTYPE_CODES[code], offsets

    def _map_tokens(self) -> np.ndarray:
        path = self.bin_path
        if not path.is_file():
            raise DataError(f"{path}: token file is missing (its index {self.idx_path.name} exists); "
                            "rebuild the dataset with `tessera preprocess`")
        num_tokens = int(self.offsets[-1])
        expected, actual = num_tokens * self.dtype.itemsize, path.stat().st_size
        if actual != expected:
            what = "truncated" if actual < expected else "longer than its index says"
            raise DataError(f"{path}: {what}: expected {expected} bytes ({num_tokens} tokens of {self.dtype} "
                            f"per {self.idx_path.name}), found {actual} bytes")
        if num_tokens == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(num_tokens,))

    def check_token_ids(self, vocab_size: int, chunk_tokens: int = CHECK_CHUNK_TOKENS) -> None:
        """Refuse the dataset if any token id is outside `0..vocab_size - 1`, before training starts.

        A `.bin` damaged on disk, or written with a larger tokenizer than the model's, would
        otherwise fail as an index error in the embedding whenever a sample first touches the bad
        id, possibly hours in. The scan is a vectorised max over memory-mapped chunks (one pass
        over the file at disk speed, `chunk_tokens` ids in memory at a time) and is skipped when
        the file's dtype cannot hold an id that large. Raises `DataError` naming the file, the
        first bad id and its token and byte offsets."""
        if vocab_size < 1:
            raise DataError(f"{self.bin_path}: cannot check token ids against a vocabulary of {vocab_size}")
        if vocab_size > np.iinfo(self.dtype).max:
            return  # every value of the file's dtype is a valid id
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = self.tokens[start:start + chunk_tokens]
            if int(chunk.max()) < vocab_size:
                continue
            offset = start + int(np.argmax(chunk >= vocab_size))
            document = int(np.searchsorted(self.offsets, offset, side="right")) - 1
            raise DataError(
                f"{self.bin_path}: token id {int(self.tokens[offset])} at token offset {offset} (byte "
                f"{offset * self.dtype.itemsize}, document {document}) is outside the model's vocabulary "
                f"(allowed 0..{vocab_size - 1}): the file is corrupt or was made with a larger tokenizer; "
                "rebuild it with `tessera preprocess` and the model's tokenizer")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, document: int) -> np.ndarray:
        n = len(self)
        if not -n <= document < n:
            raise IndexError(f"document {document} out of range for {self.prefix} ({n} documents)")
        document %= n
        return self.tokens[self.offsets[document]:self.offsets[document + 1]]

    def get(self, offset: int, length: int) -> np.ndarray:
        """`length` tokens of the concatenated stream from token `offset`, spanning documents."""
        if offset < 0 or length < 0 or offset + length > self.num_tokens:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for {self.prefix} "
                             f"({self.num_tokens} tokens)")
        return self.tokens[offset:offset + length]

    def __getstate__(self) -> dict:
        # Pickle by prefix (for data-loader workers) rather than copying the memory map's contents.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")
