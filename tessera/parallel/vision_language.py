"""A vision-language model (tessera.models.vision.llava: a vision tower, a projector, a language model;
tessera.models.vision.qwen_vl: Qwen2-VL / Qwen2.5-VL's tower with its patch merger and a qwen2 language
model) under every training layout of its language model, the image side beside it.

    model = parallelize_vision_language(llava, dims, cfg.parallel)   # the whole model or one pipeline stage

Every rank builds the same whole model (from the seed or read from a source) and this cuts it, in
`parallelize`'s order: tensor (+ sequence) parallelism, expert parallelism and context parallelism
of the language model, then FSDP. What each layout does with the images and the sequence:

- tp: the language model's plans (tensor_parallel.py); the tower and projector are replicated on
  the tp ranks, which read the same rows: each encodes the whole micro-batch's images and gets the
  whole gradient of their features.
- sp (with tp): the embedding returns the whole sequence on every tp rank (`whole_embeddings`),
  the image features are merged into it, and only then each tp rank keeps its slice of the
  sequence (`split_rows`; its backward all-gathers the slices' gradients, so the features' gradient
  is whole on every tp rank). The language model then runs as a later pipeline stage of a text
  model does under sp: its input is the local slice, its positions global (Qwen's M-RoPE
  positions, computed on the whole rows, are passed whole).
- cp: a cp rank holds its chunk of every sequence's ids (`shard_global_batch`, the split of
  `dims.cp_layout`: contiguous, or zig-zag for allgather / ring attention). The model's `sequence`
  seam all-gathers the ids (integers: exact, no gradient) into the whole sequences, every cp rank
  encodes all of the micro-batch's images (the tower is small and replicated), merges them into
  the whole sequence's embeddings and keeps the rows of its own chunk, in the order it holds them
  (`ChunkTokens`); Qwen computes its M-RoPE positions [3, B, S] on the whole rows there and keeps
  its chunk's positions the same way (`RankRows.own_positions`). The gradient that reaches the
  tower, projector and embedding on a cp rank is its chunk's share; FSDP sums the shares over
  dp_shard x cp, as for every dense weight.
- ep: the routed experts of an MoE language model are split over ep (expert_parallel.py); the
  tower and projector are dense weights outside them. (Qwen2-VL / Qwen2.5-VL's language model is a
  dense qwen2 decoder: ep is refused for them, tessera.config.training.vision_training.)
- pp: the model is cut in its language model (pipeline.split_stage): the tower and projector live
  on the first stage only, which alone receives each micro-batch's images; later stages receive
  hidden states; Qwen's M-RoPE positions reach every stage as a keyword tensor the step engine
  computes from each rank's rows (tessera.train.steps.pipeline_step). This function parallelizes one such
  stage like the whole model.
- dp_replicate / dp_shard: FSDP over the language model's blocks (each one unit, the experts
  another under ep) and one root unit over the rest (tower, projector, embedding, final norm,
  head), which the model uses before and after its blocks. With `parallel.optimizer=distributed`
  there is no FSDP: the weights stay replicated and the distributed optimizer reduces the
  gradients (tessera.parallel.distributed_optimizer).

Every rank built the same whole model, so each keeps only its shards, without communication, and
the shards are one process's weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tessera.config.parallel import ParallelConfig
from tessera.models.vision.vision_language import RowSequence
from tessera.parallel.collectives import split_rows
from tessera.parallel.context_parallel import ChunkTokens, apply_context_parallel
from tessera.parallel.data_parallel import apply_data_parallel, needs_data_parallel
from tessera.parallel.dims import ParallelDims
from tessera.parallel.expert_parallel import apply_expert_parallel
from tessera.parallel.sequence_layout import take_rank_tokens
from tessera.parallel.tensor_parallel import apply_tensor_parallel


class RankRows(RowSequence):
    """A vision-language model's `sequence` seam under cp and / or sp (module docstring): `whole`
    gathers the whole sequences' ids from the cp ranks' chunks; `own` keeps this rank's rows of the
    merged embeddings [B, S, D]: its cp chunk, then under sp its tp rank's slice of that;
    `own_positions` keeps its cp chunk of rotary positions computed on the whole rows (Qwen2-VL's
    M-RoPE, [3, B, S]), not the sp slice: under sp the language model's RoPE rotates the sequence
    its attention gathers, so it takes the positions of the whole sequence (of this cp chunk)."""

    def __init__(self, chunks: ChunkTokens | None, sp_group: ProcessGroup | None):
        self.chunks, self.sp_group = chunks, sp_group

    def whole(self, ids_BC: torch.Tensor) -> torch.Tensor:
        return ids_BC if self.chunks is None else self.chunks.whole(ids_BC)

    def own(self, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.chunks is not None:
            h_BSD = self.chunks.own(h_BSD)
        if self.sp_group is not None:
            h_BSD = split_rows(h_BSD.transpose(0, 1), self.sp_group).transpose(0, 1).contiguous()
        return h_BSD

    def own_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if self.chunks is None:
            return positions
        c = self.chunks
        return take_rank_tokens(positions, c.cp, c.cp_rank, c.layout, dim=positions.dim() - 1)


def parallelize_vision_language(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, *,
                                param_dtype: torch.dtype = torch.float32,
                                reduce_dtype: torch.dtype = torch.float32, device_type: str = "cpu") -> nn.Module:
    """`model` (a vision-language model, or one pipeline stage of one) under the layout of `dims`,
    in place (module docstring); returns it. `param_dtype` / `reduce_dtype` as in `parallelize`."""
    lm = model.language_model
    dims.validate(lm.cfg, dims.world_size, vpp=cfg.stages_per_rank)
    if dims.mesh is None:
        dims.build_mesh(device_type)
    if dims.tp > 1:
        apply_tensor_parallel(lm, dims["tp"], dims.sp, whole_embeddings=True)
    if lm.cfg.moe is not None and (dims.ep > 1 or dims.tp > 1 or dims.cp > 1):
        apply_expert_parallel(lm, dims, cfg.ep_dispatcher, cfg.ep_dispatch_dtype)
    apply_context_parallel(lm, dims)
    if dims.cp > 1 or dims.sp:
        chunks = ChunkTokens(dims["cp"].get_group(), dims.local_rank("cp"), dims.cp, dims.cp_layout) \
            if dims.cp > 1 else None
        model.sequence = RankRows(chunks, dims["tp"].get_group() if dims.sp else None)
    if cfg.optimizer == "fsdp" and needs_data_parallel(dims, param_dtype):
        apply_data_parallel(model, dims, cfg.zero_stage, param_dtype, reduce_dtype, blocks=lm.layers)
    return model
