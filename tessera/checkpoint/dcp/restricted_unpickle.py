"""Unpickling that can only build an allow-listed set of types: no code runs from a file.

`pickle.load` calls whatever importable function a file names, so a crafted file runs arbitrary
code (`os.system`, `subprocess.Popen`, ...). Two kinds of pickle remain in a Tessera checkpoint:

- DCP's `.metadata` (torch.distributed.checkpoint pickles its `Metadata` dataclass tree):
  `DCP_METADATA_GLOBALS` names exactly the classes it is made of, the torch dtypes, `torch.Size`
  and the layout/memory-format helpers.
- Trainer and RNG state of checkpoints written before these were stored as JSON:
  `LEGACY_STATE_GLOBALS` allows the builtin containers, NumPy arrays (the RNG state) and torch
  tensors, whose storage bytes are read back with `torch.load(weights_only=True)`.

Anything else is refused with a `CheckpointError` naming the global the file asked for.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from tessera.config.errors import CheckpointError

_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")


def _safe_tensor_from_bytes(data: bytes) -> Any:
    """What `torch.storage._load_from_bytes` does, without unpickling arbitrary objects."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _dcp_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md

    allowed: dict[tuple[str, str], Any] = {(_DCP_MODULE, n): getattr(dcp_md, n) for n in _DCP_CLASSES}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = __import__("pathlib").PosixPath
    allowed[("pathlib", "PurePosixPath")] = __import__("pathlib").PurePosixPath
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in dir(torch):  # every dtype pickles as a reference to its torch attribute
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    return allowed


def _legacy_state_globals() -> dict[tuple[str, str], Any]:
    import collections

    import numpy as np

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _safe_tensor_from_bytes,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's array rebuild function, either version
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
    return allowed


_BUILTINS = {("builtins", n): getattr(__import__("builtins"), n)
             for n in ("set", "frozenset", "tuple", "list", "dict", "bytearray", "slice", "complex")}
_ALLOW_LISTS: dict[str, dict[tuple[str, str], Any]] = {}


def _allowed(kind: str) -> dict[tuple[str, str], Any]:
    if kind not in _ALLOW_LISTS:
        extra = _dcp_globals() if kind == "dcp-metadata" else _legacy_state_globals()
        _ALLOW_LISTS[kind] = {**_BUILTINS, **extra}
    return _ALLOW_LISTS[kind]


class RestrictedUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` that resolves only the globals of one allow-list (`kind`)."""

    def __init__(self, file, kind: str, source: str):
        super().__init__(file)
        self.kind = kind
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _allowed(self.kind)[(module, name)]
        except KeyError:
            raise CheckpointError(f"{self.source}: refused to load {module}.{name}: a checkpoint's "
                                  f"{self.kind} may only hold plain data, never code or arbitrary "
                                  "objects (the file is damaged or was crafted)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source}: refused a persistent reference ({type(pid).__name__}) in "
                              f"{self.kind}")


def restricted_loads(data: bytes, kind: str, source: str) -> Any:
    """Unpickle `data` allowing only the globals of `kind` ("dcp-metadata" or "legacy-state")."""
    return restricted_load(io.BytesIO(data), kind, source)


def restricted_load(file, kind: str, source: str) -> Any:
    try:
        return RestrictedUnpickler(file, kind, source).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled pickle: name the file, not pickle's internals
        raise CheckpointError(f"{source}: cannot read {kind}: {type(e).__name__}: {str(e)[:200]}") from e
