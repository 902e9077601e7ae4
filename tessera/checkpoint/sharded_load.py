"""Weights into a parallelized model, each rank reading only the shards it holds.

A run that starts from pretrained weights (`train.init_from`) builds its model on the meta device
and parallelizes it like a run that starts from the seed (tessera.parallel.meta_init); then
instead of initialising by name, every parameter and buffer of every part (the parallelized model,
or this rank's pipeline stages, which keep the whole model's names) is filled from the source:

    bytes_read = load_hf_shards(parts, hf_dir, cfg.model, device)       # a HuggingFace directory
    bytes_read = load_checkpoint_shards(parts, ckpt_dir, shapes, device)  # a Tessera checkpoint

From a HuggingFace directory each tensor's box (`hf_slices.local_box`: the local shard of a
DTensor, the whole of a plain tensor) is read with `HFSliceReader`, so a rank reads its expert,
tensor- and data-parallel shards plus the replicated tensors, never the whole model. From a Tessera
checkpoint DCP plans the read: it loads only the stored chunks that overlap this rank's shards.

Buffers: the RoPE frequencies are recomputed (`reset_rope`); the MoE expert biases come from the
HuggingFace `e_score_correction_bias` where the family has one (hf_weights.hf_names), else start at
zero; a checkpoint holds them. Weights are stored in the parameters' dtype (fp32 master weights).
Tied embeddings need nothing special: `output.weight` does not exist, and every stage holding the
embedding (tessera.parallel.tied_embeddings) fills `tok_embeddings.weight` from the same tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from tessera.checkpoint import dcp as ckpt
from tessera.checkpoint.hf_slices import HFSliceReader, local_box
from tessera.checkpoint.hf_weights import IGNORED_SUFFIXES
from tessera.config.errors import CheckpointError
from tessera.config.model import ModelConfig


def check_hf_fits(reader: HFSliceReader, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse (CheckpointError naming the key and both shapes) a HuggingFace directory that lacks a
    tensor of the model, stores one with another shape, or holds weights the model has no place
    for. `shapes` are the whole model's tensors (every stage's), as built from its config."""
    needed = set()
    for key, shape in shapes.items():
        if key not in reader.names:
            if key.endswith("expert_bias"):
                continue  # a family without a stored bias: it starts at zero
            raise CheckpointError(f"{source} does not fit the model: no HuggingFace tensor maps to {key!r}")
        missing = [h for h in reader.names[key] if h not in reader.files.files]
        if missing:
            raise CheckpointError(f"{source} does not fit the model: it has no {key!r} (HuggingFace tensor "
                                  f"{missing[0]!r} is missing)")
        needed.update(reader.names[key])
        stored = reader.shape(key)
        if tuple(stored) != tuple(shape):
            raise CheckpointError(f"{source} does not fit the model: {key!r} has shape {list(stored)} there but "
                                  f"{list(shape)} in the model")
    extra = sorted(k for k in reader.files.files if k not in needed and not k.endswith(IGNORED_SUFFIXES)
                   and not (k == "lm_head.weight" and "output.weight" not in shapes))
    if extra:
        raise CheckpointError(f"{source} does not fit the model: it has {extra[0]!r}, which the model has no "
                              f"place for ({len(extra)} such tensors; is the model config the HuggingFace one?)")


def _allocate(modules: list[nn.Module], device: torch.device) -> None:
    for module in modules:
        if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            module.to_empty(device=device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def load_hf_shards(parts: Iterable[nn.Module], path: str | os.PathLike, cfg: ModelConfig,
                   device: torch.device | str, shapes: dict[str, tuple[int, ...]] | None = None,
                   source: str | None = None) -> int:
    """Fill every parameter and buffer of `parts` (Transformers or stages of one, parallelized or
    not; allocated on `device` first if they are on the meta device) from HuggingFace directory
    `path`, reading only each tensor's local box. `shapes` (default: the parts' own) are the whole
    model's, checked against the files first. Returns the bytes read from the files."""
    parts = list(parts)
    device = torch.device(device)
    reader = HFSliceReader(path, cfg)
    if shapes is None:
        shapes = {k: tuple(v.shape) for m in parts for k, v in m.state_dict().items()}
    check_hf_fits(reader, shapes, source or f"HuggingFace directory {str(path)!r}")
    _allocate(parts, device)
    for module in parts:
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        for name, t in tensors:
            if name in reader.names:
                offsets, sizes = local_box(t)
                local = _local(t)
                local.copy_(reader.read(name, offsets, sizes).to(local.dtype))
            elif name.endswith("expert_bias"):
                t.zero_()
        module.reset_rope(device)
    return reader.bytes_read


STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@torch.no_grad()
def load_checkpoint_shards(parts: Iterable[nn.Module], path: str | os.PathLike,
                           shapes: dict[str, tuple[int, ...]], device: torch.device | str) -> int:
    """Fill `parts` (as in `load_hf_shards`) with the model weights of Tessera checkpoint `path`
    (checked against its checksums and `shapes`, the whole model's), DCP reading only the stored
    chunks that overlap this rank's shards. Returns the bytes read from the checkpoint's files."""
    parts = list(parts)
    path = ckpt.verified(Path(path))
    ckpt.check_compatible(path, "model", shapes)
    _allocate(parts, torch.device(device))
    states = [get_model_state_dict(m, options=STATE_OPTIONS) for m in parts]
    wrapped = {"model": {k: v for s in states for k, v in s.items()}}
    bytes_read = ckpt.load_checkpoint(path, wrapped)
    for module, state in zip(parts, states, strict=True):
        set_model_state_dict(module, {k: wrapped["model"][k] for k in state}, options=STATE_OPTIONS)
        module.reset_rope(torch.device(device))
    return bytes_read
