"""How the ranks of tensor-parallel serving run a step together: the control messages of rank 0
(the driver) and the loop of the other ranks.

Rank 0 owns the scheduler, the block manager and sampling. Every step it broadcasts the step's
inputs to the other ranks over a CPU (gloo) control group, all ranks run the same
`PagedModel.forward_split` (so they take the same packed / bucketed paths and join the same
collectives), and the logits rows that are sampled from are gathered to rank 0 (each rank holds V/N
columns of them). Scoring runs `PagedModel.forward` instead (every item packed) and gathers every
row. The control message is one int64 header [kind, length] and one int64 payload:

    STEP:   [n_items, (n_tokens, start, n_table, adapter_slot, logits_from, n_window, state_slot, drafts,
             state_from, n_snapshots, tokens..., table..., window..., (offset, snapshot)...)*]
    PACKED: the same items, run by `PagedModel.forward`
    CLEAR:  [block ids...]      (KV blocks a request failing on inf/NaN leaves; `Scheduler.update_from_output`)
    KEEP:   [(state slot, tokens kept)...]   (after drafts were verified: `PagedModel.keep_verified`)
    STOP:   []

A hybrid model's items carry their recurrent-state slot and prefix-cache snapshots (recurrent_step.py),
which the driver alone assigns: every rank then reads and writes the same slots of its own pool, whose
states are those of its own heads (infer/scheduling/recurrent_state.py).

Rank 0's side is `tp_executor.TensorParallelModel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.config.errors import ParallelError
from tessera.infer.runner.paged_model import BatchItem, PagedModel, packed_offsets
from tessera.models.lazy_torch import local_tensor

STEP, CLEAR, STOP, PACKED, KEEP = 1, 2, 3, 4, 5


def pack_items(items: list[BatchItem]) -> list[int]:
    out = [len(items)]
    for it in items:
        window = it.window_table if it.window_table is not None else []
        out += [len(it.tokens), it.start, len(it.block_table), it.adapter_slot, it.logits_from,
                len(window) if it.window_table is not None else -1, it.state_slot, it.drafts, it.state_from,
                len(it.snapshots)]
        out += it.tokens
        out += it.block_table
        out += window
        out += [n for pair in it.snapshots for n in pair]
    return out


def _unpack_items(flat: list[int]) -> list[BatchItem]:
    items, at = [], 1
    for _ in range(flat[0]):
        n, start, nt, slot, logits_from, nw, state_slot, drafts, state_from, ns = flat[at:at + 10]
        at += 10
        tokens = flat[at:at + n]
        table = flat[at + n:at + n + nt]
        at += n + nt
        window = flat[at:at + nw] if nw >= 0 else None  # -1: no window table
        at += max(nw, 0)
        snapshots = tuple((flat[at + 2 * j], flat[at + 2 * j + 1]) for j in range(ns))
        at += 2 * ns
        items.append(BatchItem(tokens, start, table, slot, logits_from, window_table=window, state_slot=state_slot,
                               drafts=drafts, state_from=state_from, snapshots=snapshots))
    return items


def logit_rows(items: list[BatchItem], offsets: list[int]) -> list[int]:
    """Rows of the step's logits that the driver reads: each item's from `logits_from` on."""
    return [o + r for it, o in zip(items, offsets) for r in range(it.logits_from, len(it.tokens))]


def _local(x: torch.Tensor) -> torch.Tensor:
    return local_tensor(x)


class StepChannel:
    """The control plane: rank 0 sends (kind, payload) messages, the other ranks receive them.
    `data`: the group the steps' logits are gathered over (None: the world, where the serving workers
    run; a trainer's tp group when the engine runs on its ranks, tp_shared.py)."""

    def __init__(self, group: dist.ProcessGroup, data: dist.ProcessGroup | None = None):
        self.group, self.data = group, data

    def send(self, kind: int, payload: list[int]) -> None:
        dist.broadcast(torch.tensor([kind, len(payload)], dtype=torch.long), group=self.group, group_src=0)
        if payload:
            dist.broadcast(torch.tensor(payload, dtype=torch.long), group=self.group, group_src=0)

    def receive(self) -> tuple[int, list[int]]:
        header = torch.empty(2, dtype=torch.long)
        dist.broadcast(header, group=self.group, group_src=0)
        kind, n = header.tolist()
        if not n:
            return kind, []
        payload = torch.empty(n, dtype=torch.long)
        dist.broadcast(payload, group=self.group, group_src=0)
        return kind, payload.tolist()


def run_step(paged: PagedModel, kind: int, items: list[BatchItem], vocab_size: int,
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor | None, list[int]]:
    """One STEP or PACKED message on any rank of `group` (None: the world): the same forward on every
    rank, then the rows the driver reads gathered to the group's rank 0 ([T, V] there with those rows
    filled, None elsewhere)."""
    if kind == STEP:
        logits, offsets = paged.forward_split(items)
    else:
        logits, offsets = paged.forward(items), packed_offsets(items)
    local_TV = _local(logits)
    rows = logit_rows(items, offsets)
    index = torch.tensor(rows, dtype=torch.long, device=local_TV.device)
    mine_RV = local_TV.index_select(0, index).contiguous()
    world = dist.get_world_size(group)
    if dist.get_rank(group) != 0:
        dist.gather(mine_RV, None, group=group, group_dst=0)
        return None, offsets
    parts = [torch.empty_like(mine_RV) for _ in range(world)]
    dist.gather(mine_RV, parts, group=group, group_dst=0)
    full_TV = local_TV.new_empty(local_TV.shape[0], vocab_size)
    full_TV[index] = torch.cat(parts, dim=-1)
    return full_TV, offsets


def serve_worker_steps(paged: PagedModel, channel: StepChannel, vocab_size: int) -> None:
    """A worker rank's loop: mirror every message of the driver until STOP."""
    while True:
        kind, payload = channel.receive()
        if kind == STOP:
            return
        if kind == CLEAR:
            paged.clear_blocks(payload)
        elif kind == KEEP:
            paged.keep_verified(dict(zip(payload[::2], payload[1::2], strict=True)))
        elif kind in (STEP, PACKED):
            run_step(paged, kind, _unpack_items(payload), vocab_size, channel.data)
        else:
            raise ParallelError(f"unknown control message kind {kind} from the driver")
