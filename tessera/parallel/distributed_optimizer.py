"""A ZeRO-1/2 distributed optimizer with bucketed, overlapped gradient reduce-scatter and parameter
all-gather (`parallel.optimizer=distributed`; the idea of Megatron-Core's DistributedOptimizer and
of Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
stages 1 and 2). FSDP is not involved.

    weights        replicated over the data-parallel group, in the compute dtype (the MoE router's
                   stay fp32: docs/architecture.md, "Numerics contract"); each parameter is a view
                   into its bucket's parameter buffer
    gradients      summed (fp32) into contiguous per-bucket buffers by post-accumulate-grad hooks;
                   autograd's own `.grad` is released at once
    master, AdamW  fp32 master weights and both moments for this rank's 1/dp shard of every bucket

One step, for data-parallel size W and a bucket of n elements (padded to a multiple of W):
1. backward, last micro-batch: when the hook of the bucket's last parameter has run, the bucket's
   reduce-scatter (sum, fp32, n elements in, n/W out) is launched with `async_op=True`, so it runs
   while autograd computes the gradients of earlier layers. Buckets are filled in reverse
   parameter order (the order backward completes them) and launched strictly in bucket order, so
   every rank issues the same collectives in the same order even if a gradient arrives late.
   Earlier micro-batches only accumulate into the buffers (no communication).
2. `clip_grad_norm`: wait for the reduce-scatters; the global norm is the square root of the sum
   of squares of every rank's gradient shards, one all-reduce (a tensor-parallel slice that is
   replicated over tp counts once, `grad_clip.counts_on_this_rank`); the shards are scaled.
3. `step`: AdamW (torch's, over views of the fp32 master shards, decay groups as in one process)
   updates this rank's shards; each bucket's shard is cast to the compute dtype and its
   all-gather into the parameter buffer is launched asynchronously.
4. next forward: a forward pre-hook of every module that owns parameters waits for the all-gathers
   of the buckets holding them, so the first layers compute while the last buckets are still in
   flight. Overlap, honestly: the all-gathers are issued back to back at the end of `step`; on a
   backend that progresses them in the background (NCCL streams, gloo's threads) they overlap with
   whatever runs before each bucket's first use (the expert-bias update, the data loader's next
   batch, the forward of earlier layers); nothing reorders them by first use.

Under pipeline parallelism every stage part gets its own optimizer (tessera.train.builder) with
`overlap=False`: the schedule runs its micro-batches itself (and the zero-bubble schedules write
weight gradients without autograd's accumulation hooks), so gradients are taken from `.grad` and
every bucket's reduce-scatter is launched after the schedule's last backward, not during it.

Each parameter's data-parallel group is the ranks that hold the same values of it: the mesh
dimensions among dp_replicate, dp_shard and cp over which it is not split. Dense weights: all of
them (cp ranks hold the same weights and each adds its sequence chunks' share of the gradient);
expert weights under ep: dp_replicate x dp_shard_mod_ep, the expert-data-parallel ranks (MoE
parallel folding). A bucket holds parameters of one group and one dtype. Under tensor parallelism
a DTensor parameter's local slice is what goes into the buckets.
Parameters that get no gradient in a step still take an AdamW step with a zero gradient (one
process skips them); every parameter of Tessera's models receives a gradient every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.moe.router import Router
from tessera.parallel.dims import FLAT_DIMS, ParallelDims
from tessera.parallel.grad_clip import counts_on_this_rank

MIB = 1 << 20


@dataclass
class Piece:
    """One parameter's place in a bucket, and the part of it inside this rank's shard."""

    name: str
    param: nn.Parameter
    start: int  # offset of the parameter's (local) elements in the bucket
    numel: int
    counts_in_norm: bool  # whether this rank adds this parameter's gradient to the global norm
    master: torch.Tensor | None = None  # fp32 view of the master shard (None: outside this shard)


@dataclass
class Bucket:
    """Contiguous parameters of one dtype, their gradient buffer and this rank's shard of both."""

    pieces: list[Piece]
    group: Any  # the process group its parameters are replicated over
    numel: int  # padded to a multiple of the data-parallel size
    params: torch.Tensor  # [numel] compute dtype: every parameter of the bucket is a view into it
    grads: torch.Tensor  # [numel] fp32
    grad_shard: torch.Tensor  # [numel / W] fp32: the reduce-scatter's output
    master: torch.Tensor  # [numel / W] fp32
    param_shard: torch.Tensor  # [numel / W] compute dtype: the all-gather's input
    pending: int = 0  # gradients still to arrive in this backward
    reduce_work: Any = None
    gather_work: Any = None
    modules: list[nn.Module] = field(default_factory=list)


class DistributedOptimizer:
    """AdamW over sharded fp32 master weights, with bucketed reduce-scatter / all-gather (module doc).

    The trainer drives it as it drives torch's AdamW (`param_groups` for the schedule, `step`,
    `zero_grad`); the step engine calls `start_micro_batch` before each micro-batch and
    `clip_grad_norm` before the step. `named_groups`: [{"names", "params", "weight_decay"}, ...]
    as `tessera.train.optimizer.weight_decay_groups` returns them. `overlap=False`: no gradient hooks;
    `finish_gradients` takes `.grad` and launches every reduce-scatter (pipeline schedules).
    `key_prefix` names this optimizer's shards in a checkpoint (one per pipeline part)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, named_groups: list[dict], *, lr: float,
                 betas: tuple[float, float], eps: float, bucket_mb: float, param_dtype: torch.dtype,
                 fused: bool = False, overlap: bool = True, key_prefix: str = "part0"):
        self.dims = dims
        self.param_dtype = param_dtype
        self.device = next(model.parameters()).device  # of the norm's sum, also with nothing to train
        self.overlap, self.key_prefix = overlap, key_prefix
        self.reduce_scatters_launched = 0  # this backward's, for the overlap test and the curious
        self._last_micro_batch = True
        self._next_launch = 0
        keep_fp32 = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
        decay_of = {n: g["weight_decay"] for g in named_groups for n in g["names"]}
        names = [n for n, p in model.named_parameters() if p.requires_grad and n in decay_of]
        params = dict(model.named_parameters())
        self.buckets = self._build_buckets(model, names, params, keep_fp32, bucket_mb * MIB)
        groups: dict[float, list[torch.Tensor]] = {}
        for bucket in self.buckets:
            for piece in bucket.pieces:
                if piece.master is not None:
                    groups.setdefault(decay_of[piece.name], []).append(piece.master)
        self.inner = torch.optim.AdamW(
            [{"params": ps, "weight_decay": wd} for wd, ps in groups.items()] or [{"params": [torch.zeros(0)]}],
            lr=lr, betas=betas, eps=eps, fused=True if fused else None)
        self.param_groups = self.inner.param_groups

    # ---- construction ------------------------------------------------------------------------
    def _build_buckets(self, model: nn.Module, names: list[str], params: dict[str, nn.Parameter],
                       keep_fp32: set[int], bucket_bytes: float) -> list[Bucket]:
        """Fill buckets in reverse parameter order (backward's), one dtype and group per bucket."""
        runs: list[tuple[torch.dtype, tuple[str, ...], list[str]]] = []
        size = 0
        for name in reversed(names):
            dtype = torch.float32 if id(params[name]) in keep_fp32 else self.param_dtype
            replicated = replicated_dp_dims(params[name])
            numel = _local(params[name]).numel()
            if not runs or runs[-1][:2] != (dtype, replicated) or size >= bucket_bytes:
                runs.append((dtype, replicated, []))
                size = 0
            runs[-1][2].append(name)
            size += 4 * numel
        owners = _owning_modules(model)
        groups = {dims: self._group_over(dims) for dims in {r[1] for r in runs}}
        return [self._make_bucket(dtype, run, params, owners, dims, groups[dims]) for dtype, dims, run in runs]

    def _group_over(self, names: tuple[str, ...]) -> Any:
        """The process group of the ranks that differ only along mesh dimensions `names`."""
        for flat, parts in FLAT_DIMS.items():
            if parts == names:
                return self.dims[flat].get_group()
        if len(names) == 1:
            return self.dims[names[0]].get_group()
        name = "_".join(names)  # flattened once per mesh (one optimizer per pipeline part shares it)
        if name not in self.dims.flat_meshes:
            self.dims.flat_meshes[name] = self.dims[names]._flatten(name)
        return self.dims.flat_meshes[name].get_group()

    def _make_bucket(self, dtype: torch.dtype, run: list[str], params: dict[str, nn.Parameter],
                     owners: dict[int, list[tuple[nn.Module, str]]], replicated: tuple[str, ...],
                     group: Any) -> Bucket:
        W, r = dist.get_world_size(group), dist.get_rank(group)
        # every rank of the group adds its own shard: only the other dimensions decide who counts
        coords = {**self.dims.coordinates(), **dict.fromkeys(replicated, 0)}
        total = sum(_local(params[n]).numel() for n in run)
        numel = math.ceil(total / W) * W
        device = _local(params[run[0]]).device
        flat32 = torch.zeros(numel, dtype=torch.float32, device=device)
        pieces, offset = [], 0
        for name in run:
            p = params[name]
            local = _local(p)
            flat32[offset:offset + local.numel()] = local.detach().reshape(-1).float()
            pieces.append(Piece(name, p, offset, local.numel(), counts_on_this_rank(p, coords)))
            offset += local.numel()
        shard = numel // W
        lo, hi = r * shard, (r + 1) * shard
        bucket = Bucket(pieces=pieces, group=group, numel=numel, params=flat32.to(dtype),
                        grads=torch.zeros_like(flat32), grad_shard=torch.zeros(shard, device=device),
                        master=flat32[lo:hi].clone(),
                        param_shard=torch.empty(shard, dtype=dtype, device=device))
        for piece in pieces:
            a, b = max(piece.start, lo), min(piece.start + piece.numel, hi)
            if a < b:
                piece.master = bucket.master[a - lo:b - lo]
                piece.master.grad = bucket.grad_shard[a - lo:b - lo]
            piece.param = self._rebind(piece, bucket, owners)
            p = piece.param
            if self.overlap:
                piece.param.register_post_accumulate_grad_hook(self._gradient_hook(bucket, piece))
            bucket.modules += [m for m, _ in owners[id(piece.param)] if m not in bucket.modules]
        for module in bucket.modules:
            module.register_forward_pre_hook(self._wait_hook(bucket))
        return bucket

    @staticmethod
    def _rebind(piece: Piece, bucket: Bucket, owners: dict[int, list[tuple[nn.Module, str]]]) -> nn.Parameter:
        """Replace the parameter, wherever the model holds it, by one whose storage is its slice of
        the bucket's parameter buffer (a DTensor keeps its mesh, placements and global shape)."""
        old = piece.param
        view = bucket.params[piece.start:piece.start + piece.numel].view(_local(old).shape)
        if isinstance(old, DTensor):
            data = DTensor.from_local(view, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                      stride=old.stride())
        else:
            data = view
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        for module, attr in owners[id(old)]:
            module._parameters[attr] = new
        owners[id(new)] = owners.pop(id(old))
        return new

    # ---- backward: gradients into buckets, reduce-scatter as buckets complete ----------------
    def start_micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward: only the step's last one reduce-scatters."""
        self._last_micro_batch = last
        if last:
            self._next_launch = 0
            self.reduce_scatters_launched = 0
            for bucket in self.buckets:
                bucket.pending = len(bucket.pieces)

    def _gradient_hook(self, bucket: Bucket, piece: Piece):
        def hook(p: torch.Tensor) -> None:
            self._take_gradient(bucket, piece)
            if self._last_micro_batch:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch_ready_reduce_scatters()
        return hook

    @staticmethod
    def _take_gradient(bucket: Bucket, piece: Piece) -> None:
        """Add the parameter's `.grad` (its local slice) into the bucket and release it."""
        p = piece.param
        g = p.grad
        if g is None:
            return
        if isinstance(g, DTensor):
            if g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)
            g = g.to_local()
        bucket.grads[piece.start:piece.start + piece.numel].add_(g.reshape(-1))
        p.grad = None

    def _launch_ready_reduce_scatters(self, everything: bool = False) -> None:
        """Launch, in bucket order, every bucket whose gradients are complete (or all: `everything`)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not everything:
                return
            bucket.reduce_work = dist.reduce_scatter_tensor(bucket.grad_shard, bucket.grads, op=dist.ReduceOp.SUM,
                                                            group=bucket.group, async_op=True)
            self.reduce_scatters_launched += 1
            self._next_launch += 1

    def finish_gradients(self) -> None:
        """Launch what backward left (a gradient that never came; without `overlap`, every bucket, its
        gradients taken from `.grad` now) and wait for every reduce-scatter."""
        if not self.overlap:
            self._next_launch = 0
            for bucket in self.buckets:
                for piece in bucket.pieces:
                    self._take_gradient(bucket, piece)
        self._launch_ready_reduce_scatters(everything=True)
        for bucket in self.buckets:
            if bucket.reduce_work is not None:
                bucket.reduce_work.wait()
                bucket.reduce_work = None

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """The whole model's gradient norm (`clip_grad_norm` of this one optimizer)."""
        return clip_grad_norm([self], max_norm)

    @torch.no_grad()
    def local_squared_norm(self) -> torch.Tensor:
        """Sum of squares of the gradient shards this rank counts (after `finish_gradients`); 0 for a
        part with nothing to train (a pipeline stage of a frozen language model has no bucket)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for bucket in self.buckets:
            for piece in bucket.pieces:
                if piece.master is not None and piece.counts_in_norm:
                    total += piece.master.grad.float().pow(2).sum()
        return total

    @torch.no_grad()
    def scale_gradients(self, coef: torch.Tensor) -> None:
        for bucket in self.buckets:
            bucket.grad_shard.mul_(coef)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shards, then every bucket's all-gather launched (waited for by the
        forward pre-hooks of the modules that use it)."""
        self.inner.step()
        for bucket in self.buckets:
            bucket.param_shard.copy_(bucket.master)
            bucket.gather_work = dist.all_gather_into_tensor(bucket.params, bucket.param_shard, group=bucket.group,
                                                             async_op=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.grads.zero_()
            bucket.grad_shard.zero_()

    def _wait_hook(self, bucket: Bucket):
        def hook(module: nn.Module, args: Any) -> None:
            if bucket.gather_work is not None:
                bucket.gather_work.wait()
                bucket.gather_work = None
        return hook

    def wait_for_params(self) -> None:
        """Wait for every pending all-gather (before the weights are read outside a forward)."""
        for bucket in self.buckets:
            if bucket.gather_work is not None:
                bucket.gather_work.wait()
                bucket.gather_work = None

    # ---- checkpoints -------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's master shards and AdamW moments, under keys unique to this rank's place in
        the layout (a checkpoint resumes under the same layout only)."""
        self.wait_for_params()
        prefix = f"rank{dist.get_rank()}.{self.key_prefix}"
        out: dict[str, torch.Tensor] = {}
        for b, bucket in enumerate(self.buckets):
            out[f"{prefix}.bucket{b}.master"] = bucket.master
        for i, piece in enumerate(self._shard_pieces()):
            state = self.inner.state.get(piece.master)
            if not state:  # before the first step: zeros, the state a first step starts from
                state = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(piece.master),
                         "exp_avg_sq": torch.zeros_like(piece.master)}
                self.inner.state[piece.master] = state
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{prefix}.piece{i}.{key}"] = state[key]
        return out

    def _shard_pieces(self) -> list[Piece]:
        return [p for bucket in self.buckets for p in bucket.pieces if p.master is not None]


@torch.no_grad()
def clip_grad_norm(optimizers: list[DistributedOptimizer], max_norm: float) -> float:
    """Wait for the optimizers' reduce-scatters; the whole model's gradient norm from the reduced
    shards of all of them (one all-reduce over the world: pipeline stages hold different
    parameters, data-parallel ranks different shards); the shards scaled so that it is at most
    `max_norm` (<= 0: only measured). Returns the norm before clipping."""
    for optimizer in optimizers:
        optimizer.finish_gradients()
    total = sum((o.local_squared_norm() for o in optimizers[1:]), optimizers[0].local_squared_norm())
    dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for optimizer in optimizers:
            optimizer.scale_gradients(coef)
    return float(norm)


DP_DIMS = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp")


def replicated_dp_dims(p: torch.Tensor) -> tuple[str, ...]:
    """The data-parallel mesh dimensions over which `p` holds the same values on every rank: those
    its DTensor placements do not split (dense weights: all of them, the flat "dp_cp")."""
    split: set[str] = set()
    if isinstance(p, DTensor):
        for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
            if not placement.is_replicate():
                split.update(FLAT_DIMS.get(name, (name,)))
    return tuple(d for d in DP_DIMS if d not in split)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _owning_modules(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) that holds it directly (a tied weight has two)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    return owners
