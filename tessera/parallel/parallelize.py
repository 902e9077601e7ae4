"""`parallelize(model, dims, cfg)`: every parallelism applied from outside, in one place, in a fixed
order (docs/architecture.md, "Parallelize and its seams"): tensor/sequence parallel, expert parallel, context
parallel, activation checkpointing, compile (`compile_blocks=True`), activation offload, data parallel. Pipeline
splitting, when used, happens before, on each stage.

Initialisation: build the full model on every rank from one seed (`Transformer(cfg, init_seed)`
initialises every tensor from (seed, its name), so all ranks hold the same weights), then call
`parallelize`, which keeps on each rank only its shards, without communication. The result is
the same model under every layout. For models too large for one device, build on the meta device
instead, parallelize, then `meta_init.materialize_by_name` allocates and initialises only this
rank's shards, to the same values (tessera.train.builder does this on ranks).

    dims = ParallelDims.from_config(run.parallel, world_size)
    dims.validate(run.model, world_size, seq_len)       # before allocating anything
    dims.build_mesh("cuda" or "cpu")
    model = parallelize(Transformer(run.model, init_seed=seed), dims, run.parallel)
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config.errors import ParallelError
from tessera.config.parallel import ParallelConfig
from tessera.parallel.compile import compile_blocks as compile_each_block
from tessera.parallel.context_parallel import apply_context_parallel
from tessera.parallel.data_parallel import apply_data_parallel, needs_data_parallel
from tessera.parallel.dims import ParallelDims
from tessera.parallel.expert_parallel import apply_expert_parallel
from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing
from tessera.parallel.memory.activation_offload import apply_activation_offload
from tessera.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, *,
                param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
                device_type: str = "cpu", compile_blocks: bool = False) -> nn.Module:
    """Apply TP/SP, EP, CP, activation checkpointing, compile, activation offload and FSDP to `model` in
    place and return it.

    Under cp > 1 the model then takes this rank's chunk of every sequence (`shard_global_batch`)
    and its attention sees the whole sequence (context_parallel.py).

    `param_dtype` is the compute dtype of the weights under FSDP mixed precision (bf16 on GPUs;
    the fp32 shards stay the master copy), `reduce_dtype` that of gradient reduction.
    MoE tokens reach the experts of other ranks through `cfg.ep_dispatcher` (expert_dispatch.py).
    `compile_blocks` compiles each transformer block (tessera.parallel.compile, `train.compile`).
    """
    if dims.pp > 1 and getattr(model, "pipeline_stage", None) is None:
        raise ParallelError(f"pp={dims.pp}: split the model into stages first (tessera.parallel.pipeline), "
                            "then parallelize each stage")
    dims.validate(model.cfg, dims.world_size, vpp=cfg.stages_per_rank)
    if dims.mesh is None:
        dims.build_mesh(device_type)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims["tp"], dims.sp)
    if getattr(model.cfg, "moe", None) is not None and (dims.ep > 1 or dims.tp > 1 or dims.cp > 1):
        apply_expert_parallel(model, dims, cfg.ep_dispatcher, cfg.ep_dispatch_dtype)
    apply_context_parallel(model, dims)
    apply_activation_checkpointing(model, cfg.recompute, cfg.recompute_interval, save=cfg.recompute_save,
                                   fp8=cfg.activation_fp8)
    if compile_blocks:
        compile_each_block(model, param_dtype)
    if cfg.activation_offload:
        apply_activation_offload(model, device_type)
    # parallel.optimizer=distributed: no FSDP; the distributed optimizer (distributed_optimizer.py)
    # is built over the weights once they are materialised (tessera.train.builder).
    if cfg.optimizer == "fsdp" and needs_data_parallel(dims, param_dtype):
        apply_data_parallel(model, dims, cfg.zero_stage, param_dtype, reduce_dtype)
    return model
