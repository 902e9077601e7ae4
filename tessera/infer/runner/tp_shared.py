"""Tensor-parallel serving on ranks that already run together, over weights they already hold: the
serving engine of a GRPO run under tensor parallelism (tessera/eval/rollouts.py).

A trainer under tp holds its policy cut over the tp group, each weight a DTensor whose local tensor is
this rank's shard. When the serving plan cuts the model the same way (the same tp size, so the same
shard boundaries: both are `tessera.parallel.tensor_parallel`'s plan, and an MoE model's routed experts
each cut on their hidden dim over tp by `expert_parallel.py`, as serving cuts them), `alias_shards`
builds the serving model over those very tensors: a model shell on the meta device, cut by the plan, each parameter then
the trainer's own tensor (a DTensor where cut, the whole tensor where not: norms), and turned into
plain local tensors with the plan's collectives as hooks (`tensor_parallel.to_plain_tensors`). The
engine's weights are then the trainer's storage: no copy is made, and an optimizer step that updates
them in place is what the next decode reads. Where the layouts differ (the trainer also shards over
dp_shard, ep or cp, a weight is placed otherwise, a row-parallel bias, whose copy the serving plan zeroes
on all ranks but one) it returns None. Where only the other mesh dims differ (FSDP2 over dp_shard on
top of the serving cut), `gathered_shards` builds the same tp-cut serving model with storage of its
own, and `gather_shards` fills it in place from the policy after each optimizer step (a gather over
dp_shard, a collective every rank calls); otherwise the caller keeps a whole gathered copy. A hybrid's
recurrent mixers read parts of weights training keeps whole on every tp rank: over the policy's own
tensors (`alias_shards`) they stay whole, their parts kept and read again after an update
(`tensor_parallel.KeptParts`); in a copy of its own (`gathered_shards`) only this rank's parts are held,
and `gather_shards` copies those parts in.

The group's rank 0 drives the engine: `LLMEngine.from_group_shard` builds it over a
`TensorParallelExecutor` whose workers are the group's other ranks (`GroupPeers`), already running:
each of them calls `serve_group_steps`, which mirrors every step (tp_channel.py) until the driver's
engine closes (its STOP). Between building and the first step the group's ranks agree that all built
their part (`agreed_build`), so a failure on any of them reaches all at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessera.config.errors import TrainingError
from tessera.config.parallel import ParallelConfig
from tessera.infer.config import EngineConfig
from tessera.infer.runner.paged_model import build_paged_model
from tessera.infer.runner.tensor_parallel import to_plain_tensors
from tessera.infer.runner.tp_channel import STOP, StepChannel, serve_worker_steps
from tessera.models.transformer import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.expert_parallel import apply_expert_parallel
from tessera.parallel.tensor_parallel import apply_tensor_parallel


@torch.no_grad()
def alias_shards(policy: Transformer, dims: ParallelDims) -> Transformer | None:
    """A serving model of this rank's tp shard whose parameters are `policy`'s local tensors (module
    docstring), or None where the trainer's layout is not the serving plan's."""
    params = dict(policy.named_parameters())
    tp_mesh = dims["tp"]
    cut = [p for p in params.values() if isinstance(p, DTensor)]
    if not cut or any(p.device_mesh != tp_mesh for p in cut) or dims.ep > 1 or dims.cp > 1:
        return None  # no weight cut, one cut over more than the tp group (dp_shard, ep), or experts over cp
    shell = _serving_shell(policy, dims)
    if shell is None:
        return None
    mine = dict(shell.named_parameters())
    if not all(_same_box(mine[k], params[k]) for k in mine):
        return None
    for name, p in params.items():
        _put(shell, name, _served(mine[name], p))
    shell.reset_rope(cut[0].device)
    return to_plain_tensors(shell.eval(), tp_mesh.get_group())


@torch.no_grad()
def gathered_shards(policy: Transformer, dims: ParallelDims) -> Transformer | None:
    """A serving model of this rank's tp shard with storage of its own, for a policy whose shards also
    span other mesh dims (dp_shard: FSDP2 over tp): `gather_shards` fills it. None where the policy's
    cut over tp is not the serving plan's (or there is no tp, or experts over ep / cp)."""
    cut = [p for p in policy.parameters() if isinstance(p, DTensor)]
    if dims.tp == 1 or not cut or dims.ep > 1 or dims.cp > 1:
        return None
    shell = _serving_shell(policy, dims)
    if shell is None:
        return None
    device, tp_mesh = cut[0].device, dims["tp"]
    for name, p in policy.named_parameters():
        serving = shell.get_parameter(name)
        if _tp_placement(p) != (serving.placements[-1] if isinstance(serving, DTensor) else Replicate()):
            return None
        if isinstance(serving, DTensor):
            local = torch.empty(serving.to_local().shape, dtype=p.dtype, device=device)
            _put(shell, name, DTensor.from_local(local, tp_mesh, serving.placements, run_check=False,
                                                 shape=serving.shape, stride=serving.stride()))
        else:
            _put(shell, name, torch.empty(serving.shape, dtype=p.dtype, device=device))
    shell.reset_rope(device)
    return to_plain_tensors(shell.eval(), tp_mesh.get_group(), cut_whole=True)


@torch.no_grad()
def gather_shards(served: Transformer, policy: Transformer) -> None:
    """`served` (`gathered_shards`) given the policy's weights in place: each parameter gathered over
    every mesh dim but tp (a collective over those ranks: every rank calls it), this rank's tp shard kept;
    of a recurrent mixer's weight the policy keeps whole, the part the served model holds (`whole_index`)."""
    mine = dict(served.named_parameters())
    for name, p in policy.named_parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            kept = [pl if n == "tp" else Replicate() for n, pl in zip(names, p.placements, strict=True)]
            p = p.redistribute(p.device_mesh, kept).to_local()
        part = getattr(mine[name], "whole_index", None)
        mine[name].copy_(p if part is None else p.index_select(part[0], part[1]))


def _serving_shell(policy: Transformer, dims: ParallelDims) -> Transformer | None:
    """The policy's model on the meta device cut by serving's tp plan (experts too), or None where its
    parameters differ or a row-parallel bias exists (to_plain_tensors zeroes it on all ranks but one)."""
    with torch.device("meta"):
        shell = Transformer(policy.cfg, init_seed=None)
    apply_tensor_parallel(shell, dims["tp"], sp=False)  # the plan of serving (and of training, less its sp hooks)
    if getattr(policy.cfg, "moe", None) is not None:  # each expert's hidden dim over tp, as serving cuts it
        apply_expert_parallel(shell, dims, ParallelConfig(tp=dims.tp).ep_dispatcher)
    if {n for n, _ in shell.named_parameters()} != {n for n, _ in policy.named_parameters()}:
        return None
    for module in shell.modules():
        if isinstance(module, nn.Linear) and module.bias is not None and module.weight.placements[-1] == Shard(1):
            return None
    return shell


def _put(shell: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(shell.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


def _tp_placement(p: torch.Tensor):
    """How `p` is cut over the tp mesh dim (Replicate where it is not a DTensor or not over tp)."""
    if not isinstance(p, DTensor):
        return Replicate()
    names = p.device_mesh.mesh_dim_names or ()
    return p.placements[names.index("tp")] if "tp" in names else Replicate()


def _whole(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)


def _same_box(serving: torch.Tensor, trained: torch.Tensor) -> bool:
    """Both cut alike (DTensors of one placement), or both whole (a norm's weight: plain, or replicated
    under sp), one shape."""
    if _whole(serving) != _whole(trained):
        return False
    placed = _whole(trained) or tuple(serving.placements) == tuple(trained.placements)
    return placed and serving.shape == trained.shape and serving.dtype == trained.dtype


def _served(serving: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """The tensor the serving model holds for `trained`: its DTensor where serving cuts it too, else
    its whole local tensor (the same storage either way)."""
    if isinstance(trained, DTensor) and not isinstance(serving, DTensor):
        return trained.detach().to_local()
    return trained.detach()


class GroupPeers:
    """The other ranks of `group` as `TensorParallelExecutor` drives its workers: already running
    (`serve_group_steps`), so nothing to start or watch; stopping them is the STOP message, sent only
    once they serve (`serving`: every rank of the group has built its part, `agreed_build`)."""

    failure = None

    def __init__(self, group: dist.ProcessGroup):
        self.channel = StepChannel(group, data=group)
        self.serving = False

    def guarded(self, fn):
        return fn()

    def stop(self) -> None:
        if self.serving:
            self.serving = False
            self.channel.send(STOP, [])


def agreed_build(group: dist.ProcessGroup, error: Exception | None) -> None:
    """Every rank of `group` says whether it built its part of the engine (one gather of their
    outcomes); if any failed, all raise now, the failing rank its own error, the others a
    TrainingError naming the first failing rank and its reason, instead of a driver stepping into
    peers that never answer (or peers waiting for a driver that never steps) until the collective
    timeout."""
    reasons: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, None if error is None else str(error), group=group)
    failed = [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
    if not failed:
        return
    if error is not None:
        raise error
    raise TrainingError(f"the tp group's rank {failed[0][0]} failed to build its engine: {failed[0][1]}")


def serve_group_steps(model: Transformer, config: EngineConfig, group: dist.ProcessGroup) -> None:
    """A rank of `group` other than 0: its shard's paged model (a KV cache of this phase, freed on
    return) mirrors the driver's steps until its engine closes. A failure building it, or the
    driver's or another peer's, raises here before any step (`agreed_build`)."""
    paged, error = None, None
    try:
        paged, _ = build_paged_model(model, config, None)
    except Exception as e:
        error = e
    agreed_build(group, error)
    serve_worker_steps(paged, StepChannel(group, data=group), model.cfg.vocab_size)
