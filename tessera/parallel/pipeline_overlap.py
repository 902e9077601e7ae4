"""DualPipeV's overlapped pairs: the forward of one micro-batch and the backward of another run at
once, so that each one's expert all-to-alls hide behind the other's compute (DeepSeek-V3's DualPipe,
arXiv 2412.19437, section 3.2.1).

torch's `ScheduleDualPipeV` pairs them in its steady state as one `OVERLAP_F_B` action whose two
sub-actions (a FORWARD of one stage, a FULL_BACKWARD of this rank's other stage) it runs one after the
other. `overlap_pairs` registers the action's function instead: the inputs both wait for are taken
on the calling thread, then the forward runs on a worker thread while the backward runs on the
calling thread (CPU autograd runs a backward on the thread that starts it), and the pair ends when
both have. The sends and receives stay the schedule's own actions, before and after the pair.

Two threads must never interleave their collectives on one process group (every rank would have to
interleave them in the same order). The forward thread therefore runs inside `collectives.lane`:
the expert dispatcher's group (`ep`) is replaced there by its twin, a second communicator over the
same ranks made by `twin_groups`. Every rank of a group runs the same pairs in the same order, so each communicator
sees one ordered stream. Collectives that do not go through `tessera.parallel.collectives` (tensor
parallelism's DTensor styles, context parallelism's attention exchanges) have no lane, so the pairs
overlap only where a stage's forward and backward issue no others: `overlaps(dims)`, tp = cp = 1.
FSDP's gathers and reductions run in the schedule's own UNSHARD / REDUCE_GRAD actions, outside
the pairs, and the distributed optimizer starts its reduce-scatters after the schedule.

Autocast, grad mode and the current CUDA device are thread-local: the worker enters the caller's. The
numbers are those of the pairs run in turn (the two sub-actions touch different stages' modules and
micro-batches). Proven on CPU over gloo (tests/parallel/test_dualpipe_overlap.py, bench/dualpipe_overlap.py).
On CUDA both threads still issue their kernels on the device's current stream, where a collective
holds back the kernels queued behind it: the GPU overlap needs a stream per thread, not built yet.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import schedules as torch_schedules

from tessera.parallel.collectives import lane
from tessera.parallel.dims import BASE_DIMS, FLAT_DIMS, ParallelDims

LANED_DIMS = ("ep",)  # the group of the MoE dispatcher's collectives (tp: none, `overlaps`)


def overlaps(dims: ParallelDims) -> bool:
    """Whether a stage's forward and backward issue only laned collectives (expert parallelism's)."""
    return dims.tp == 1 and dims.cp == 1


def _rank_lists(dims: ParallelDims, name: str) -> list[list[int]]:
    """The ranks of every group along mesh dimension `name` (base or flattened), on every rank alike."""
    parts = FLAT_DIMS.get(name, (name,))
    ranks = dims.mesh.mesh
    axes = [BASE_DIMS.index(p) for p in parts]
    rest = [i for i in range(ranks.dim()) if i not in axes]
    return ranks.permute(*rest, *axes).reshape(-1, dims.size(name)).tolist()


def twin_groups(dims: ParallelDims, names: tuple[str, ...] = LANED_DIMS) -> dict[ProcessGroup, ProcessGroup]:
    """This rank's group along each of `names` (of more than one rank) -> a new group over the same
    ranks. A collective call on every rank (each group is created everywhere, in one order)."""
    me, twins = dist.get_rank(), {}
    for name in names:
        if dims.size(name) == 1:
            continue
        mine = None
        for ranks in _rank_lists(dims, name):
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
        twins[dims[name].get_group()] = mine
    return twins


def _forward(runtime, stages: dict, action, ctx, twins: dict, modes: tuple) -> None:
    """The FORWARD sub-action (torch's runtime's, less the input wait done by the caller)."""
    device_type, autocast_on, autocast_dtype, grad_on = modes
    stage = stages[action.stage_index]
    mb = action.microbatch_index
    if device_type == "cuda":
        torch.cuda.set_device(stage.device)
    with lane(twins), torch.set_grad_enabled(grad_on), \
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=True)
        runtime._maybe_compute_loss(stage, output, ctx.target_mbs, mb)  # noqa: SLF001
    if action.stage_index + 1 in stages:  # the V's turn: the next stage is on this rank
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)


def _backward(runtime, stages: dict, action) -> None:
    """The FULL_BACKWARD sub-action (torch's runtime's, less the input wait done by the caller)."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    loss = runtime._maybe_get_loss(stage, mb)  # noqa: SLF001
    runtime.backward_counter[action.stage_index] += 1
    last = runtime.backward_counter[action.stage_index] == runtime._n_microbatches  # noqa: SLF001
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if action.stage_index - 1 in stages:
        stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _wait_inputs(runtime, stages: dict, fwd, bwd) -> None:
    """What torch's runtime waits for before each sub-action: unsharded weights, received inputs."""
    for a in (fwd, bwd):
        runtime._assert_unsharded(stages[a.stage_index])  # noqa: SLF001
    if not stages[fwd.stage_index].is_first and fwd.stage_index - 1 not in stages:
        torch_schedules._wait_batch_p2p(runtime.fwd_recv_ops.pop((fwd.stage_index, fwd.microbatch_index)))  # noqa: SLF001
    if not stages[bwd.stage_index].is_last and bwd.stage_index + 1 not in stages:
        torch_schedules._wait_batch_p2p(runtime.bwd_recv_ops.pop((bwd.stage_index, bwd.microbatch_index)))  # noqa: SLF001


class OverlappedPairs:
    """The `OVERLAP_F_B` function of a DualPipeV schedule: the pair's forward on a worker thread in the
    twin groups' lane, its backward on the calling thread."""

    def __init__(self, twins: dict[ProcessGroup, ProcessGroup]):
        self.twins = twins
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dualpipev-forward")
        self.pairs = 0  # pairs run overlapped (what a test counts)

    def __call__(self, action, ctx) -> None:
        runtime = ctx.schedule_ref
        fwd, bwd = action.sub_actions
        stages = {s.stage_index: s for s in runtime._stages}  # noqa: SLF001
        _wait_inputs(runtime, stages, fwd, bwd)
        device_type = stages[fwd.stage_index].device.type
        modes = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                 torch.is_grad_enabled())
        forward = self.worker.submit(_forward, runtime, stages, fwd, ctx, self.twins, modes)
        try:
            _backward(runtime, stages, bwd)
        finally:
            forward.result()
        self.pairs += 1


def overlap_pairs(schedule, dims: ParallelDims) -> OverlappedPairs:
    """Make `schedule` (torch's ScheduleDualPipeV) run its paired forwards and backwards at once; a
    collective call on every rank (the twin groups)."""
    pairs = OverlappedPairs(twin_groups(dims))
    schedule.register_custom_function(torch_schedules.OVERLAP_F_B, pairs)
    return pairs
