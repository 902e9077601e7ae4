"""Tied embeddings across pipeline stages (Megatron-LM's embedding group, Narayanan et al. 2021).

With `tie_embeddings` the embedding matrix E is used twice: the first stage looks tokens up in it
and the last stage's LM head projects onto it (logits = h E^T). The two stages live on different
pipeline ranks (stage 0 on pp rank 0, the last stage on pp rank pp-1, also with virtual stages),
so each holds a copy of E under the same name, `tok_embeddings.weight`:

- both copies start equal: initialisation is by name from one seed (meta_init.py);
- after backward the copies' gradients are summed over the two ranks that hold them
  (`reduce_gradients`), so each copy holds the gradient of E in the whole model: the embedding's
  share from the first stage plus the head's from the last;
- the gradient norm counts E once: the last stage's copy is `uncounted` (grad_clip.py clips it
  with the same coefficient without adding it to the norm);
- the same gradient, clipping and AdamW update on both keep the copies equal, bit for bit;
- checkpoints hold E once: both stages save the same name and DCP writes a tensor that several
  ranks save under one name once (each loads it back).

Each copy may itself be split by FSDP or tensor parallelism; the two ranks of a pair have the
same coordinates in every other mesh dimension, so they hold the same shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from tessera.parallel.dims import ParallelDims


def embedding_group(dims: ParallelDims) -> ProcessGroup | None:
    """This rank's group of (first-stage rank, last-stage rank) with equal other coordinates; None
    on middle pipeline ranks. Every rank must call it (it creates one group per pair)."""
    grid = dims.mesh.mesh  # [pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp] global ranks
    pairs = [[int(a), int(b)] for a, b in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist())]
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine


class TiedEmbeddings:
    """The copies of the tied embedding on this rank's pipeline stages, and the group that sums
    their gradients (module docstring)."""

    def __init__(self, parts: list[nn.Module], dims: ParallelDims):
        self.group = embedding_group(dims)
        decoders = [getattr(m, "language_model", m) for m in parts]  # a vision-language stage's decoder
        self.holders = [m for m in decoders if getattr(m, "tok_embeddings", None) is not None]

    # Looked up on each call: materialising a meta-built model replaces its parameters.
    @property
    def copies(self) -> list[torch.Tensor]:
        return [m.tok_embeddings.weight for m in self.holders]

    @property
    def uncounted(self) -> list[torch.Tensor]:
        """The last stage's copy (the stage with the head); the norm counts the first stage's."""
        return [m.tok_embeddings.weight for m in self.holders if m.norm is not None]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum the copies' gradients over the first and last stage (every rank of a pair calls it)."""
        for weight in self.copies:
            if isinstance(weight.grad, DTensor) and weight.grad.placements != weight.placements:
                # The vocab-parallel embedding's backward leaves a replicated gradient: keep this
                # rank's shard, as the head's gradient on the other stage is (no communication).
                weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
            grad = weight.grad.to_local() if isinstance(weight.grad, DTensor) else weight.grad
            buffer = grad.contiguous()
            dist.all_reduce(buffer, group=self.group)
            if buffer is not grad:
                grad.copy_(buffer)
