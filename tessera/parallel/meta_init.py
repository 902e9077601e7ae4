"""Build the model on the meta device, parallelize it, then give each rank only its own weights.

A model of 8B+ parameters does not fit whole on every rank, so on several ranks the model is
built without storage (`with torch.device("meta")`), cut into pipeline stages and shards
(TP/SP, EP, CP, FSDP all work on meta modules: they only look at shapes), and then materialised:

    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
        reference = Transformer(cfg, init_seed=None)   # names and shapes of the whole model
    parts = [parallelize(model, dims, pcfg)]           # or a pipeline's stage modules
    materialize_by_name(parts, reference, seed, device)

`materialize_by_name` allocates this rank's storage (`to_empty`) and sets every tensor BY NAME to
exactly what `Transformer.init_weights(seed)` gives it on one process (docs/architecture.md,
"Numerics contract": initialisation by parameter name from one seed): the whole value is
computed on its own, from (seed, name) (`Transformer.initial_value`), and a DTensor parameter
keeps the shard its placements select (`distribute_tensor(..., src_data_rank=None)`: every rank
cuts its own piece, no communication).
Buffers: the RoPE frequencies are recomputed and the MoE expert biases start at zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tessera.models.transformer import Transformer


@torch.no_grad()
def materialize_by_name(modules: Iterable[nn.Module], reference: Transformer, seed: int,
                        device: torch.device | str) -> None:
    """Allocate `modules` (meta, possibly parallelized Transformers or stages of one) on `device`
    and initialise each parameter and buffer as `init_weights(seed)` does on one process.
    `reference` is the whole model (meta is enough) that owns every parameter name."""
    device = torch.device(device)
    for module in modules:
        module.to_empty(device=device)
        for name, p in module.named_parameters():
            full = reference.initial_value(name, seed).to(device)
            if isinstance(p, DTensor):
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(shard)
            else:
                p.copy_(full)
        for name, b in module.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        module.reset_rope(device)
