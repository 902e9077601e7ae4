"""A Tessera checkpoint's model weights into a rank's model parts (checkpoint/parts.py): DCP plans
the read and loads only the stored chunks that overlap this rank's shards."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.parts import allocate

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
PARTIAL_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # what `shapes` names


@torch.no_grad()
def load_checkpoint_shards(parts: Iterable[nn.Module], path: str | os.PathLike,
                           shapes: dict[str, tuple[int, ...]], device: torch.device | str) -> int:
    """Fill `parts` (Transformers or stages of one, parallelized or not; allocated on `device` first
    if they are on the meta device) with the model weights of Tessera checkpoint `path` (checked
    against its checksums and `shapes`, the whole model's), DCP reading only the stored chunks that
    overlap this rank's shards. A tensor of the parts that `shapes` does not name is left for the
    caller to fill (the adapters of train.lora over a base read from a checkpoint). Returns the bytes
    read from the checkpoint's files."""
    parts = list(parts)
    path = ckpt.verified(Path(path))
    ckpt.check_compatible(path, "model", shapes)
    allocate(parts, torch.device(device))
    states = [{k: v for k, v in get_model_state_dict(m, options=STATE_OPTIONS).items() if k in shapes}
              for m in parts]
    wrapped = {"model": {k: v for s in states for k, v in s.items()}}
    bytes_read = ckpt.load_checkpoint(path, wrapped)
    for module, state in zip(parts, states, strict=True):
        set_model_state_dict(module, {k: wrapped["model"][k] for k in state}, options=PARTIAL_OPTIONS)
        module.reset_rope(torch.device(device))
    return bytes_read
