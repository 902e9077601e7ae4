"""Tensor-parallel serving: the model cut over N ranks, one scheduler driving all of them.

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

Rank 0 is the driver: it owns the scheduler, the block manager and sampling. Every step it
broadcasts the step's inputs to the other ranks over a CPU (gloo) control group, all ranks run
the same `ModelRunner.forward_split` (so they take the same packed / bucketed paths and join the
same collectives), and the logits rows that are sampled from are gathered to rank 0 (each rank
holds V/N columns of them). The control message is one int64 header [kind, length] and one int64
payload:

    STEP:  [n_items, (n_tokens, start, n_table, adapter_slot, logits_from, tokens..., table...)*]
    CLEAR: [block ids...]      (KV blocks a failed request leaves; `LLMEngine._fail_alone`)
    STOP:  []

Processes, start-up and failure handling are in `tp_workers.py`.
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
from tessera.infer.model_runner import BatchItem, ModelRunner
from tessera.models.transformer import Transformer
from tessera.parallel.dims import ParallelDims
from tessera.parallel.parallelize import parallelize

STEP, CLEAR, STOP = 1, 2, 3


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


@torch.no_grad()
def to_plain_tensors(model: Transformer, group: dist.ProcessGroup) -> Transformer:
    """Replace every DTensor weight of the cut model by its local shard, with the collectives its
    placement implies installed as forward hooks (module docstring). The plan's own DTensor
    hooks on those modules are removed; the model's seams go back to their one-process forms."""
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


def load_hf_shard(path, cfg: ModelConfig, dims: ParallelDims, dtype: torch.dtype,
                  device: torch.device | str) -> Transformer:
    """This rank's shard of the HuggingFace model at `path` (`_load_hf_shard`), cut in a thread of
    its own."""
    return _in_a_thread_of_its_own(_load_hf_shard, path, cfg, dims, dtype, device)


def cut_for_serving(model: Transformer, dims: ParallelDims) -> Transformer:
    """This rank's shard of a whole model (identical on every rank), as plain tensors, cut in a
    thread of its own."""
    return _in_a_thread_of_its_own(_cut_for_serving, model, dims)


def _load_hf_shard(path, cfg: ModelConfig, dims: ParallelDims, dtype: torch.dtype,
                   device: torch.device | str) -> Transformer:
    """This rank's shard of the HuggingFace model at `path`, reading only its box of every tensor
    (`checkpoint.hf.load.build_from_hf`, the filler training's `init_from` uses): built on the meta
    device, cut, then filled from the files."""
    from tessera.checkpoint.hf.load import build_from_hf

    model = build_from_hf(path, cfg, dtype, device, cut=lambda m: shard_model(m, dims))
    return to_plain_tensors(model, dims["tp"].get_group())


def _cut_for_serving(model: Transformer, dims: ParallelDims) -> Transformer:
    return to_plain_tensors(shard_model(model.eval(), dims), dims["tp"].get_group())


def _pack_items(items: list[BatchItem]) -> list[int]:
    out = [len(items)]
    for it in items:
        out += [len(it.tokens), it.start, len(it.block_table), it.adapter_slot, it.logits_from]
        out += it.tokens
        out += it.block_table
    return out


def _unpack_items(flat: list[int]) -> list[BatchItem]:
    items, at = [], 1
    for _ in range(flat[0]):
        n, start, nt, slot, logits_from = flat[at:at + 5]
        at += 5
        tokens = flat[at:at + n]
        table = flat[at + n:at + n + nt]
        at += n + nt
        items.append(BatchItem(tokens, start, table, slot, logits_from))
    return items


def logit_rows(items: list[BatchItem], offsets: list[int]) -> list[int]:
    """Rows of the step's logits that the driver reads: each item's from `logits_from` on."""
    return [o + r for it, o in zip(items, offsets) for r in range(it.logits_from, len(it.tokens))]


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


class StepChannel:
    """The control plane: rank 0 sends (kind, payload) messages, the other ranks receive them."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, kind: int, payload: list[int]) -> None:
        dist.broadcast(torch.tensor([kind, len(payload)], dtype=torch.long), 0, group=self.group)
        if payload:
            dist.broadcast(torch.tensor(payload, dtype=torch.long), 0, group=self.group)

    def receive(self) -> tuple[int, list[int]]:
        header = torch.empty(2, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        kind, n = header.tolist()
        if not n:
            return kind, []
        payload = torch.empty(n, dtype=torch.long)
        dist.broadcast(payload, 0, group=self.group)
        return kind, payload.tolist()


def run_step(runner: ModelRunner, items: list[BatchItem], vocab_size: int
             ) -> tuple[torch.Tensor | None, list[int]]:
    """One step on any rank: the same forward on every rank, then the rows the driver samples
    from gathered to rank 0 ([T, V] there with those rows filled, None elsewhere)."""
    logits, offsets = runner.forward_split(items)
    local_TV = _local(logits)
    rows = logit_rows(items, offsets)
    index = torch.tensor(rows, dtype=torch.long, device=local_TV.device)
    mine_RV = local_TV.index_select(0, index).contiguous()
    world = dist.get_world_size()
    if dist.get_rank() != 0:
        dist.gather(mine_RV, None, dst=0)
        return None, offsets
    parts = [torch.empty_like(mine_RV) for _ in range(world)]
    dist.gather(mine_RV, parts, dst=0)
    full_TV = local_TV.new_empty(local_TV.shape[0], vocab_size)
    full_TV[index] = torch.cat(parts, dim=-1)
    return full_TV, offsets


class TensorParallelRunner:
    """The driver's runner: the engine calls it as it calls a `ModelRunner`; it has the other
    ranks run the same step and returns full-vocabulary logits of the rows the engine reads."""

    def __init__(self, runner: ModelRunner, workers):
        self.runner, self.workers = runner, workers  # workers: tp_workers.WorkerGroup
        self.kv, self.decoder = runner.kv, runner.decoder
        self.vocab_size = runner.model.cfg.vocab_size

    def forward_split(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        def step():
            self.workers.channel.send(STEP, _pack_items(items))
            logits, offsets = run_step(self.runner, items, self.vocab_size)
            if logits.is_cuda:
                # NCCL collectives only queue work: a rank that died or failed shows at the next
                # wait on the device. Waiting here makes that happen inside `guarded`, which
                # names the rank and marks the group failed, instead of at sampling's host copy.
                torch.cuda.synchronize(logits.device)
            return logits, offsets
        return self.workers.guarded(step)

    @property
    def failure(self):
        """The WorkerFailure that ended tensor-parallel serving (None while healthy)."""
        return self.workers.failure

    def clear_blocks(self, blocks: list[int]) -> None:
        if blocks:
            self.workers.guarded(lambda: self.workers.channel.send(CLEAR, list(blocks)))
        self.runner.clear_blocks(blocks)

    def close(self) -> None:
        self.workers.stop()


def serve_worker_steps(runner: ModelRunner, channel: StepChannel, vocab_size: int) -> None:
    """A worker rank's loop: mirror every message of the driver until STOP."""
    while True:
        kind, payload = channel.receive()
        if kind == STOP:
            return
        if kind == CLEAR:
            runner.clear_blocks(payload)
        elif kind == STEP:
            run_step(runner, _unpack_items(payload), vocab_size)
        else:
            raise ParallelError(f"unknown control message kind {kind} from the driver")
