"""`train.init_from`: a run's starting weights from a HuggingFace directory or a Tessera checkpoint.

Each rank reads only what its parts hold (the whole model in one process; the meta-built,
parallelized shards or pipeline stages on several: tessera.checkpoint.hf.load and
tessera.checkpoint.dcp.shards). Optimizer, schedule and step start fresh. A HuggingFace directory
whose shapes do not fit the model section is refused with the model fields that make them differ.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.shards import load_checkpoint_shards
from tessera.checkpoint.hf.load import load_hf_shards
from tessera.config.errors import CheckpointError, TesseraError
from tessera.config.hf_config import is_hf_directory, model_differences, read_language_model_config
from tessera.config.model import ModelConfig


def load_initial_weights(parts: list[nn.Module], path: str, model_cfg: ModelConfig,
                         full_shapes: dict[str, tuple[int, ...]], device: torch.device) -> int:
    """Fill `parts` from `path`; returns the bytes this rank read. `full_shapes`: every tensor of
    the whole model (all stages), as built from `model_cfg`."""
    if not is_hf_directory(path):
        return load_checkpoint_shards(parts, ckpt.resolve_checkpoint(path), full_shapes, device)
    try:
        return load_hf_shards(parts, path, model_cfg, device, shapes=full_shapes,
                              source=f"train.init_from={path!r}")
    except CheckpointError as e:  # say which fields of the model section make the shapes differ
        try:
            differences = model_differences(model_cfg, read_language_model_config(path), shapes_only=True)
        except TesseraError:  # a config.json Tessera cannot read: the weights' own check said what is wrong
            differences = []
        if not differences:
            raise
        raise CheckpointError(
            f"{e}; the model section differs from {str(Path(path) / 'config.json')!r} in "
            f"{', '.join(differences[:4])}{' and more' if len(differences) > 4 else ''}: leave those to the "
            f"directory (model.from_hf={path!r} takes every field not given from it)") from e
