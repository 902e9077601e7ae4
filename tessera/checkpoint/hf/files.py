"""Reading the files of a HuggingFace model directory as untrusted input.

A model directory comes from anywhere, so every file is checked before use and every problem is
one CheckpointError naming the file: JSON that does not parse or is not an object, a config field
that is missing or has the wrong type, a safetensors file that is truncated or whose header is
malformed (a header length of 2^62, ...), tensors that are not floating point, and an index whose
`weight_map` names a file outside the directory (`../x`, an absolute path, a symbolic link out):
weights are read only from files inside the model directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tessera.config.errors import CheckpointError
from tessera.config.hf_config import read_json_object

INDEX = "model.safetensors.index.json"

def _inside(directory: Path, name: Any, source: Path) -> Path:
    """`directory / name` if that is a file inside `directory` (after following links), else refuse."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
        raise CheckpointError(f"{str(source)!r} names weight file {name!r}, which is not a relative path inside "
                              "the model directory; refusing to read it")
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"{str(source)!r}: weight file {name!r} leads outside the model directory (a "
                              "symbolic link); refusing to read it")
    return path


def _open(path: Path):
    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file ({e}); it may be truncated "
                              "or damaged") from e


class SafetensorsDir:
    """Lazy reader over the safetensors files of a directory: key -> file, tensors read on demand."""

    def __init__(self, path: Path):
        index = path / INDEX
        if index.exists():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
                raise CheckpointError(f"{str(index)!r} has no \"weight_map\" object (tensor name -> file name)")
            self.files = {k: _inside(path, f, index) for k, f in weight_map.items()}
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX}")
            self.files = {}
            for shard in shards:
                _inside(path, shard.name, path)
                with _open(shard) as f:
                    self.files.update({k: shard for k in f.keys()})
        for f in set(self.files.values()):
            if not f.is_file():
                raise CheckpointError(f"{path}: {INDEX} names {f.name}, which does not exist")
        self._open: dict[Path, object] = {}

    def keys(self) -> set[str]:
        return set(self.files)

    def handle(self, f: Path):
        """The open safetensors file `f` (opened once, until `release`)."""
        if f not in self._open:
            self._open[f] = _open(f)
        return self._open[f]

    def release(self, f: Path) -> None:
        """Close `f`'s mapping: the pages a read touched stop counting in this process's resident memory
        (a tensor read from it owns its data; the next read opens the file again)."""
        self._open.pop(f, None)

    def get(self, key: str) -> torch.Tensor:
        f = self.files[key]
        try:
            t = self.handle(f).get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{str(f)!r}: cannot read tensor {key!r} ({e}); the file may be damaged") from e
        if not t.is_floating_point():
            raise CheckpointError(f"{str(f)!r}: tensor {key!r} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                  "model weights must be floating point (float32, bfloat16, float16)")
        return t
