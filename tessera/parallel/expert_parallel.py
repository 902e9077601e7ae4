"""Expert parallelism (EP) and expert tensor parallelism: split the experts' weights, install a
communicating dispatcher, and make the router's balancing statistics micro-batch-wide, all
through the seams the MoE layer declares (`MoE.dispatcher`, `GroupedExperts.local_weight`,
`Router.reduce_counts`).

How the expert weights [E, F, D] (w1, w3) and [E, D, F] (w2) are split:

    ep > 1: experts over the `ep` mesh dim (Shard(0)): rank r owns experts [r E/ep, (r+1) E/ep).
    tp > 1: every expert's hidden dim F over `tp` (w1/w3 Shard(1), w2 Shard(2)): the column- /
            row-parallel split of a dense MLP, applied inside each expert (expert TP = TP).
    both:   placements (Shard(0), Shard(1 or 2)) on the (ep, tp) mesh.

The weights stay DTensors (global shapes and names unchanged, so checkpoints reload under any
layout); the experts' `local_weight` accessor becomes `local_shard`, so their own forward computes
on this rank's shards. Quantized experts (a pre-quantized checkpoint's, or quantized at load) hold
no parameters to split and are refused by name. Expert weights are data-parallel over the ranks that ep does not use
(dp_replicate x dp_shard_mod_ep); `data_parallel.py` shards them there.

Router statistics: the balancing losses need the routing counts of the whole micro-batch.
Under tensor/sequence parallelism every tp rank routes all the micro-batch's tokens (the MoE
block gathers the sequence first), and under expert/data parallelism each rank routes its own
micro-batch, so no reduction is needed; the ranks that hold different tokens of one micro-batch
are the `cp` ranks, and `MicroBatchCountReducer` sums counts over them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tessera.config.errors import ParallelError
from tessera.config.parallel import EP_DISPATCHERS
from tessera.models.moe.biased_experts import BiasedExperts
from tessera.models.moe.experts import GroupedExperts, Relu2Experts
from tessera.models.moe.layer import MoE
from tessera.parallel.dims import ParallelDims
from tessera.parallel.expert_dispatch import AllGatherDispatcher, AllToAllDispatcher


def local_shard(w: torch.Tensor) -> torch.Tensor:
    """The experts' `LocalWeight` under EP / expert TP: this rank's shard of a DTensor weight."""
    return w.to_local() if isinstance(w, DTensor) else w


class MicroBatchCountReducer:
    """The router's `reduce_counts` when one micro-batch's tokens are spread over `group`: sums
    the per-expert routing counts and the token count over it, so every rank's balancing loss
    uses micro-batch-wide f_i and T (Switch eq. 4) while P_i stays its own tokens' share; the
    ranks' losses then add up to the micro-batch's loss. The router also passes it each sequence's
    per-expert counts [B*E] and its chunk length, for the sequence-level loss (DeepSeek-V2)."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def __call__(self, counts_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
        tokens = counts_E.new_tensor([num_tokens], dtype=torch.int64)
        both = torch.cat([counts_E.detach().to(torch.int64), tokens])
        dist.all_reduce(both, group=self.group)
        return both[:-1].to(counts_E.dtype), int(both[-1].item())


def expert_mesh_names(dims: ParallelDims, experts: nn.Module | None = None) -> tuple[str, ...]:
    """Mesh dims the expert weights are split over (empty: not split); experts whose hidden dim is not
    cut (`split_dims` None: gpt-oss's biased experts) are whole on every tp rank."""
    whole_over_tp = experts is not None and None in getattr(experts, "split_dims", {}).values()
    return tuple(n for n, size in (("ep", dims.ep), ("tp", dims.tp)) if size > 1 and not (n == "tp" and whole_over_tp))


def shard_expert_weights(experts: GroupedExperts, dims: ParallelDims) -> None:
    """Replace the full expert weights (identical on every rank) by DTensors holding this rank's
    shard; no communication (each rank cuts its own piece)."""
    names = expert_mesh_names(dims, experts)
    if not names:
        return
    if not isinstance(experts, GroupedExperts | BiasedExperts | Relu2Experts) or getattr(experts, "quantized", False):
        raise ParallelError(f"routed experts stored quantized ({type(experts).__name__}) are not split over "
                            f"{' and '.join(names)}: expert parallelism splits full-precision expert parameters; "
                            "run quantized experts with ep=1 and tp=1")
    mesh = dims[names]
    for pname, hidden_dim in experts.split_dims.items():
        placements = [Shard(0) if n == "ep" else Shard(hidden_dim) for n in names]
        full = getattr(experts, pname)
        sharded = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
        experts.register_parameter(pname, nn.Parameter(sharded, requires_grad=full.requires_grad))
    experts.local_weight = local_shard


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, dispatcher: str = "alltoall",
                          dispatch_dtype: str = "input") -> None:
    """Split every MoE layer's experts over ep (and their hidden dim over tp) and install the
    communicating dispatcher (`dispatch_dtype`: parallel.ep_dispatch_dtype); with cp > 1, make router
    counts micro-batch-wide."""
    if dispatcher not in EP_DISPATCHERS:
        raise ParallelError(f"parallel.ep_dispatcher={dispatcher!r} is invalid: one of {', '.join(EP_DISPATCHERS)}")
    ep_group = dims["ep"].get_group() if dims.ep > 1 else None
    cp_group = dims["cp"].get_group() if dims.cp > 1 else None
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        cfg = module.cfg
        tp_group = dims["tp"].get_group() if "tp" in expert_mesh_names(dims, module.experts) else None
        if ep_group is not None or tp_group is not None:
            shard_expert_weights(module.experts, dims)
            if dispatcher == "allgather":
                if cfg.pad_to_capacity:
                    raise ParallelError("moe.pad_to_capacity=true needs parallel.ep_dispatcher=alltoall, "
                                        "not allgather")
                module.dispatcher = AllGatherDispatcher(cfg.num_experts, ep_group, tp_group)
            else:
                module.dispatcher = AllToAllDispatcher(cfg.num_experts, ep_group, tp_group,
                                                       cfg.pad_to_capacity, dispatch_dtype == "compute")
        if cp_group is not None:
            module.router.reduce_counts = MicroBatchCountReducer(cp_group)
