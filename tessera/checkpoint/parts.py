"""The model parts a rank fills from a checkpoint of either format, reading only what it holds.

A run that starts from pretrained weights (`train.init_from`) builds its model on the meta device
and parallelizes it like a run that starts from the seed (tessera.parallel.meta_init), and
tensor-parallel serving builds and cuts its shard the same way; then, instead of initialising by
name, every parameter and buffer of every part (the parallelized model, or this rank's pipeline
stages, which keep the whole model's names; or one whole model) is filled from the source:

    bytes_read = load_hf_shards(parts, hf_dir, cfg.model, device)         # checkpoint/hf/load.py
    bytes_read = load_checkpoint_shards(parts, ckpt_dir, shapes, device)  # checkpoint/dcp/shards.py

Buffers: the RoPE frequencies are recomputed (`reset_rope`); the MoE expert biases come from the
HuggingFace `e_score_correction_bias` where the family has one (hf/names.py), else start at zero;
a Tessera checkpoint holds them. Weights are stored in the parameters' dtype (fp32 master weights).
Tied embeddings need nothing special: `output.weight` does not exist, and every stage holding the
embedding (tessera.parallel.tied_embeddings) fills `tok_embeddings.weight` from the same tensor.
"""

from __future__ import annotations

import torch
from torch import nn


def allocate(parts: list[nn.Module], device: torch.device) -> None:
    """Storage on `device` for the parts still on the meta device (their values come from the source)."""
    for module in parts:
        if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            module.to_empty(device=device)
