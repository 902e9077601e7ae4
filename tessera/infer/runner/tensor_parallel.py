"""Tensor-parallel serving: cutting the model over N ranks.

How the weights are cut is training's plan, applied by the parallel layer's one entry point
(`tessera.parallel.parallelize` with `tp=N`): query/key/value and the MLP's w1/w3 column-parallel
(each rank holds H/N query heads, G/N KV heads, F/N hidden units), wo/w2 row-parallel (partial
sums all-reduced), the embedding and head vocabulary-parallel, and each MoE expert's hidden dim
split over the ranks (expert tensor parallelism). The attention seam therefore sees the rank's
local heads, and each rank's paged KV cache holds only those (`PagedKVCache(..., tp_size=N)`).

DTensor's dispatch (sharding propagation on every op, for shapes that change every step) costs
more than a small model's whole decode step, so after the plan has cut the weights they are
turned into plain local tensors (`to_plain_tensors`), and the communication the plan implies is
read off each weight's placement: a Linear whose weight is Shard(1) (row-parallel) all-reduces its
output (its bias kept on rank 0 only, so it is added once); an Embedding whose weight is Shard(0)
(vocabulary-parallel) looks up the ids of its slice and all-reduces; Shard(0) Linears
(column-parallel, the head) and replicated weights need nothing. MoE experts keep the parallel
layer's dispatcher, which sums their partial outputs over the ranks.

A hybrid model's recurrent mixers keep some weights whole on every rank in training and read this
rank's rows, channels and heads of them through their `own_part` seam (training's `DeltaNetRankPart`,
`MambaRankPart`). A model cut for serving (`cut_for_serving`, `serving_shard_from_hf`) keeps only those
parts: each rank's whole weights are cut to them at load (the parts' `cut`) and the mixer reads them
as they are (`own_part` whole), so a rank holds 1/tp of them (so does a GRPO engine's copy of the
trainer's shard, tp_shared.py's `gathered_shards`). A serving model over a GRPO trainer's own tensors
(`alias_shards`) must keep them whole, since the trainer's optimizer updates them in place: there
`KeptParts` keeps each part after its first read and reads it again only when its tensor's version
has moved.

How the ranks run a step together is in `tp_channel.py`; their processes, start-up and failure
handling in `tp_workers.py`; rank 0's side in `tp_executor.py`.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tessera.config.errors import ConfigError, ParallelError
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.infer.cpu.gguf_matmul import use_block_kernels
from tessera.infer.runner import gguf_shards
from tessera.models.linear_attention.gated_deltanet import whole
from tessera.models.transformer import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.parallelize import parallelize


def serving_dims(cfg: ModelConfig, tp: int) -> ParallelDims:
    """The layout of N-way tensor-parallel serving, checked against the model's shapes (the
    layout rules: N must divide the heads, KV heads, vocabulary and FFN dims)."""
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp} is invalid: must be >= 1")
    dims = ParallelDims(tp=tp, world_size=tp)
    try:
        dims.validate(cfg, tp)
    except ParallelError as e:
        raise ConfigError(f"tensor_parallel_size={tp} is invalid for this model: {e}") from e
    return dims


def shard_model(model: Transformer, dims: ParallelDims) -> Transformer:
    """Cut `model` (full weights, or on the meta device) over the built mesh of `dims` in place,
    by the parallel layer's plan; each rank keeps its own slices without communication. The
    weights stay DTensors (their boxes say what to load); `to_plain_tensors` comes after loading."""
    return parallelize(model, dims, ParallelConfig(tp=dims.tp), param_dtype=torch.float32)


class _RowParallelSum:
    """Forward hook of a row-parallel Linear: the sum of the ranks' partial outputs."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, module, args, out_BSD: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out_BSD, group=self.group)
        return out_BSD


class _VocabParallelLookup:
    """Hooks of a vocabulary-parallel Embedding holding rows [first, first + n): ids outside the
    slice look up row 0 and are zeroed, then the ranks' rows are summed (Megatron-LM)."""

    def __init__(self, first: int, n: int, group: dist.ProcessGroup):
        self.first, self.n, self.group = first, n, group
        self.outside: torch.Tensor | None = None

    def before(self, module, args):
        ids = args[0] - self.first
        self.outside = (ids < 0) | (ids >= self.n)
        return (ids.masked_fill(self.outside, 0),) + tuple(args[1:])

    def after(self, module, args, out_BSD: torch.Tensor) -> torch.Tensor:
        out_BSD = out_BSD.masked_fill(self.outside[..., None], 0)
        self.outside = None
        dist.all_reduce(out_BSD, group=self.group)
        return out_BSD


class KeptParts:
    """A recurrent mixer's `own_part` for serving (module docstring): `part`'s answer for each weight (a
    parameter itself: in_proj's rows, the norm's gains), kept until the weight is written in place; what
    the mixer builds each call (its input, a view or a concatenation of weights) is sliced each call."""

    def __init__(self, part):
        self.part = part
        self.kept: dict[tuple[str, int], tuple[int, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "input" or not isinstance(t, nn.Parameter):
            return self.part(name, t)
        key = (name, id(t))
        hit = self.kept.get(key)
        if hit is not None and hit[0] == t._version and hit[1] is t:
            return hit[2]
        out = self.part(name, t)
        self.kept[key] = (t._version, t, out)
        return out


@torch.no_grad()
def to_plain_tensors(model: Transformer, group: dist.ProcessGroup, cut_whole: bool = False) -> Transformer:
    """Replace every DTensor weight of the cut model by its local shard, with the collectives its
    placement implies installed as forward hooks (module docstring). The plan's own DTensor
    hooks on those modules are removed; the model's seams go back to their one-process forms.
    `cut_whole`: the recurrent mixers' whole weights are cut to this rank's parts (the model owns
    them); else each part is read once and kept beside them (`KeptParts`: they are shared)."""
    from tessera.checkpoint.hf.slices import local_box
    from tessera.models.transformer import tied_projection

    rank = dist.get_rank(group)
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if not any(isinstance(p, DTensor) for p in params.values()):
            continue
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        placement = weight.placements[-1] if isinstance(weight, DTensor) else None
        offsets, sizes = local_box(weight) if weight is not None else ((), ())
        for name, p in params.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            setattr(module, name, nn.Parameter(local, requires_grad=False))
        if isinstance(module, nn.Linear) and placement == Shard(1):
            if module.bias is not None and rank != 0:
                module.bias.zero_()
            module.register_forward_hook(_RowParallelSum(group))
        elif isinstance(module, nn.Embedding) and placement == Shard(0):
            lookup = _VocabParallelLookup(offsets[0], sizes[0], group)
            module.register_forward_pre_hook(lookup.before)
            module.register_forward_hook(lookup.after)
    if model.cfg.tie_embeddings:
        model.tied_head = tied_projection  # the local embedding rows: this rank's vocabulary slice
    for module in model.modules():  # a recurrent mixer's parts of its whole weights: cut, or read once
        part = getattr(module, "own_part", None)
        if part is None or part is whole or isinstance(part, KeptParts):
            continue
        if cut_whole:
            part.cut(module)
            module.own_part = whole
        else:
            module.own_part = KeptParts(part)
    return model


def _in_a_thread_of_its_own(fn, *args):
    """`fn(*args)` run in a short-lived thread, its exception re-raised here.

    Cutting a model goes through DTensor, whose sharding caches are per thread and keyed without
    the rank (the cached results hold the mesh they were computed on). Rank 0 is the serving
    process, which may fork later or build another mesh (a test process, a notebook): done in its
    own thread, the cut leaves no cached result behind to hand a later mesh this one's coordinates.

    A CUDA build of torch on a machine without a usable GPU sets up its CUDA device guard the first
    time a fake tensor mode is entered (DTensor's sharding propagation enters one); set up in a
    thread that then exits, the next thread to enter one crashes (torch 2.11, segmentation fault on
    the second cut in a process). It is set up here, in the calling thread, first: that holds as long
    as the calling thread outlives the cuts, as the main thread does (an LLM built from a short-lived
    thread of its own would meet the crash again)."""
    cuda_build_without_gpu = torch.backends.cuda.is_built() and not torch.cuda.is_available()
    if cuda_build_without_gpu and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        torch._C._ensureCUDADeviceGuardSet()
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            with torch.no_grad():
                result.append(fn(*args))
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="tessera-tp-cut")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def serving_shard_from_hf(path, cfg: ModelConfig, dims: ParallelDims, dtype: torch.dtype,
                  device: torch.device | str) -> Transformer:
    """This rank's shard of the HuggingFace model at `path` (`_serving_shard_from_hf`), cut in a thread of
    its own."""
    return _in_a_thread_of_its_own(_serving_shard_from_hf, path, cfg, dims, dtype, device)


def cut_for_serving(model: Transformer, dims: ParallelDims, block_kernels: bool = False) -> Transformer:
    """This rank's shard of a whole model (identical on every rank), as plain tensors, cut in a
    thread of its own; `block_kernels`: its kept GGUF blocks multiplied by the CPU block kernel."""
    model = _in_a_thread_of_its_own(_cut_for_serving, model, dims)
    if block_kernels:
        use_block_kernels(model)
    return model


def _serving_shard_from_hf(path, cfg: ModelConfig, dims: ParallelDims, dtype: torch.dtype,
                   device: torch.device | str) -> Transformer:
    """This rank's shard of the HuggingFace model at `path`, reading only its box of every tensor
    (`checkpoint.hf.load.build_from_hf`, the filler training's `init_from` uses): built on the meta
    device, cut, then filled from the files."""
    from tessera.checkpoint.hf.load import build_from_hf

    model = build_from_hf(path, cfg, dtype, device, cut=lambda m: shard_model(m, dims))
    return to_plain_tensors(model, dims["tp"].get_group(), cut_whole=True)


def _cut_for_serving(model: Transformer, dims: ParallelDims) -> Transformer:
    """The plan's cut; a GGUF model's kept blocks cut beside it, each rank keeping its part (gguf_shards.py)."""
    kept = gguf_shards.stand_in(model)
    model = shard_model(model.eval(), dims)
    cut = gguf_shards.boxes(model, kept)
    group = dims["tp"].get_group()
    return gguf_shards.put_back(to_plain_tensors(model, group, cut_whole=True), kept, cut, dist.get_rank(group))
