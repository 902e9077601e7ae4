"""Data parallelism with FSDP2 (`fully_shard`): sharded (ZeRO), hybrid-sharded (HSDP) or replicated.

    dp_shard > 1 (x cp)       weights, gradients and optimizer state sharded over dp_shard_cp
    dp_replicate > 1          HSDP: sharded inside a replica group, all-reduced across groups;
                              with dp_shard = 1 this is plain replication (DDP-equivalent)
    ep > 1                    expert weights are sharded over dp_shard_mod_ep (the dp ranks that
                              ep does not use), and replicated over dp_replicate

Each block is one FSDP unit (one all-gather / reduce-scatter), the experts of an MoE block
another when ep > 1, and the root (embedding, final norm, head) the last.

Gradient reduction SUMS over data-parallel ranks (divide factor 1). This matches the numerics
contract: every rank's loss is its token-loss sum divided by the loss tokens of the whole global
batch, so the sum of the ranks' gradients is the gradient of the global-batch loss.

`zero_stage`: 3 frees the gathered weights after each block's forward and gathers them again in
backward; 2 and 1 keep them gathered between forward and backward (FSDP2 always shards
gradients, so stage 1 behaves as stage 2).

Mixed precision: parameters are cast to `param_dtype` for compute (the fp32 sharded copy is the
master), gradients are reduced in `reduce_dtype`. The MoE router is the exception
(docs/architecture.md, "Numerics contract": fp32 router): under a low-precision `param_dtype`
each router is its own FSDP unit whose policy keeps its weight in fp32, so routing decisions see
the master weights, as in one process (in fp32 layouts the router stays inside its block's unit).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tessera.parallel.dims import ParallelDims


def dense_dp_mesh(dims: ParallelDims) -> DeviceMesh:
    """Mesh FSDP uses for non-expert weights: (dp_replicate, dp_shard_cp), or dp_shard_cp alone."""
    return dims["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else dims["dp_shard_cp"]


def expert_dp_mesh(dims: ParallelDims) -> DeviceMesh:
    """Mesh FSDP uses for expert weights under ep: the dp ranks that ep leaves."""
    return dims["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else dims["dp_shard_mod_ep"]


def needs_data_parallel(dims: ParallelDims, param_dtype: torch.dtype) -> bool:
    return dims.dp_size * dims.cp > 1 or param_dtype != torch.float32


def apply_data_parallel(model: nn.Module, dims: ParallelDims, zero_stage: int = 3,
                        param_dtype: torch.dtype = torch.float32,
                        reduce_dtype: torch.dtype = torch.float32, blocks: nn.ModuleDict | None = None) -> None:
    """Wrap blocks, expert groups and the root with `fully_shard`; gradients are summed. `blocks`:
    the transformer blocks when they are not `model.layers` (a vision-language model's language
    model's; everything else, the tower included, is then in the root's unit)."""
    mp = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                              reduce_dtype=reduce_dtype)
    reshard = zero_stage == 3
    mesh = dense_dp_mesh(dims)
    # param_dtype=None: the router's weight is gathered in its own dtype (fp32) and its inputs are
    # not cast (the router computes its logits in fp32 anyway).
    router_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    mtp = getattr(model, "mtp", None) or {}  # multi-token prediction blocks: wrapped like the layers
    for block in [*(model.layers if blocks is None else blocks).values(), *(m.block for m in mtp.values())]:
        if dims.ep > 1 and hasattr(block, "moe"):
            fully_shard(block.moe.experts, mesh=expert_dp_mesh(dims), reshard_after_forward=reshard,
                        mp_policy=mp)
        if mp.param_dtype is not None and hasattr(block, "moe"):
            fully_shard(block.moe.router, mesh=mesh, reshard_after_forward=reshard, mp_policy=router_mp)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
