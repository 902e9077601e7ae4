"""Reading DCP checkpoints without unpickling arbitrary objects.

torch's `FileSystemReader.read_metadata` reads `.metadata` with `pickle.load`, and its default
load planner reads non-tensor items with `torch.load(weights_only=False)`: either runs whatever
code a crafted file names. `SafeFileSystemReader` reads `.metadata` with the restricted unpickler
(`restricted_unpickle.py`) and checks that every data file it names is a plain file inside the
checkpoint directory; `SafeLoadPlanner` reads non-tensor items with `torch.load(weights_only=True)`.
Tensor data was already read with `weights_only=True` by torch itself. `BoxLoadPlanner` reads a box
(offsets and a shape) of a stored tensor into a plain tensor, in one process, whatever ranks and
shards wrote it: one expert of a stacked [E, out, in] weight, for example.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tessera.checkpoint.dcp.checksums import DCP_METADATA
from tessera.checkpoint.dcp.restricted_unpickle import restricted_load
from tessera.config.errors import CheckpointError

_PLAIN_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def read_dcp_metadata(checkpoint: str | os.PathLike) -> Metadata:
    """The `Metadata` of a DCP checkpoint directory, read with the restricted unpickler and checked."""
    path = Path(checkpoint) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = restricted_load(f, "dcp-metadata", str(path))
    except OSError as e:
        raise CheckpointError(f"cannot read {str(path)!r}: {e.strerror or e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{str(path)!r} is not DCP metadata (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _PLAIN_FILE_NAME.match(name) or name == DCP_METADATA:
            raise CheckpointError(f"{str(path)!r} names data file {name!r}, which is not a plain file name in "
                                  "the checkpoint directory; refusing to read outside it")
        data_file = Path(checkpoint) / name
        if data_file.is_symlink():
            raise CheckpointError(f"{str(data_file)!r} is a symbolic link; checkpoint data files must be "
                                  "plain files inside the checkpoint directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata comes from `read_dcp_metadata` (no arbitrary unpickling).
    `bytes_read` counts the stored bytes of every item this rank's load plan read."""

    bytes_read = 0

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not used by Tessera checkpoints")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor items with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            reasons = [p.strip() for p in str(e).split("\n\n") if p.strip().startswith("Trying to load")]
            first = reasons[0][:200] if reasons else type(e).__name__  # torch's reason, without its advice
            raise CheckpointError(f"refused to load the stored object {fqn!r}: a checkpoint may only hold "
                                  f"tensors and plain data ({first})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class BoxLoadPlanner(SafeLoadPlanner):
    """Loads into each tensor of a flat state dict {stored key: tensor} the box of the stored tensor
    that starts at `offsets[key]` and has the tensor's shape. DCP's resharding reads the parts of
    every stored shard that overlap the box, so a box can span the shards of several ranks."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, tensor in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no tensor {key!r}")
            start = tuple(self.offsets[key])
            if len(start) != len(md.size) or any(
                    o < 0 or o + n > m for o, n, m in zip(start, tensor.shape, md.size, strict=True)):
                raise CheckpointError(f"box {list(start)} + {list(tensor.shape)} lies outside {key!r} of shape "
                                      f"{list(md.size)}")
            box = ChunkStorageMetadata(offsets=torch.Size(start), sizes=tensor.size())
            requests += create_read_items_for_chunk_list(key, md, [box])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]
