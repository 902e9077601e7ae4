"""The recurrent-state slots of a hybrid model, beside the paged KV cache.

A hybrid decoder's recurrent layers (Gated DeltaNet, Mamba-2: tessera/models/linear_attention) keep
per sequence a fixed-size state instead of keys and values that grow with it, of the layout its
mixer declares (`state_layouts`, models/linear_attention/states.py): the short convolution's last
W-1 inputs (channels x (W-1), in the engine's dtype) and the recurrence's state (Gated DeltaNet's
value heads x key dim x value dim, Mamba-2's heads x head dim x state size; fp32). The attention
layers of the same model keep using the paged blocks (kv_cache.py); nothing here names a family.

`RecurrentStatePool` holds, per recurrent layer, one tensor of `num_slots` such states per field; a
slot is one running sequence's. `StateSlots` is the driver's bookkeeping of which request owns which
slot: a request takes a free slot the first step it runs (admission) and gives it back when the
scheduler releases it (finish, abort, or preemption: `SchedulerOutput.released`). A step whose item
starts at position 0 zeroes its slot first (a new sequence, or a preempted one being recomputed
from its prompt: recompute preemption needs nothing more), and every later chunk of a chunked
prefill, and every decode step, starts from the state the previous one left there. The pool has
`max_num_seqs` slots, the most sequences the scheduler runs at once, so admission never waits for a
slot; their bytes are paid out of the KV budget first (`bytes_per_slot`; `paged_model.cache_geometry`).

Speculative decoding: a step verifying drafts keeps the state after each of the item's tokens and
writes back the one after the accepted drafts (`recurrent_step.py`), so rejected drafts leave no trace.

Prefix caching: the state after a prompt prefix is not reconstructible from cached KV blocks, so
the pool also holds snapshots of it at block boundaries, kept beside their named blocks
(state_snapshots.py); with no room for one (`bytes_per_slot` over the budget's half) prefix caching
is off (`prefix_caching`). What the slot cannot do (`refuse_unsupported`, a typed error naming the
setting): the KV tiers, disaggregated prefill and system prompts move or pin KV blocks whose states
are not kept.

Tensor-parallel serving: each rank's pool holds the states of its own heads only (`tp`: the layouts
of one of tp ranks, states.py), its slot and snapshot numbers the driver's (every rank runs the same
items, tp_channel.py), so a slot's state is the concatenation of the ranks' parts and never crosses
between them. Its bytes are counted per rank, as the KV cache's are.
Shapes: N slots (and snapshots after them).
"""

from __future__ import annotations

import logging

import torch

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.linear_attention.states import StateLayout, state_layouts

log = logging.getLogger("tessera.infer")


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether `cfg` has layers that keep a per-sequence recurrent state."""
    return bool(state_layouts(cfg))


def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """One sequence's recurrent state over every layer that keeps one, in bytes, on one of `tp` ranks."""
    elem = torch.empty((), dtype=dtype).element_size()
    layouts = state_layouts(cfg, tp).values()
    return sum(own * elem + fp32 * 4 for own, fp32 in (layout.elements() for layout in layouts))


class RecurrentStatePool:
    """Per recurrent layer, `num_slots` states of the layout its mixer declares (`StateLayout`,
    models/linear_attention/states.py): one tensor [N, *shape] per field, fp32 or the engine's dtype,
    zero until written; after them `num_snapshots` more of each, the prefix cache's snapshots
    (state_snapshots.py); `tp`: the states of one of that many tensor-parallel ranks (module docstring)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 num_snapshots: int = 0, tp: int = 1):
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        n = num_slots + num_snapshots
        self.layouts: dict[int, StateLayout] = state_layouts(cfg, tp)
        self.layers = list(self.layouts)
        self.tensors = {i: {f.name: torch.zeros(n, *f.shape, dtype=torch.float32 if f.fp32 else dtype,
                                                device=device) for f in layout.fields}
                        for i, layout in self.layouts.items()}

    def snapshot_index(self, snapshot: int) -> int:
        """Where snapshot `snapshot` lives in the pool's tensors."""
        return self.num_slots + snapshot

    def copy(self, layer_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the states at indices `src` to `dst` in layer `layer_id` (every field the layer keeps)."""
        if not src:
            return
        for t in self.tensors[layer_id].values():
            s, d = (torch.tensor(i, dtype=torch.long, device=t.device) for i in (src, dst))
            t.index_copy_(0, d, t.index_select(0, s))

    def reset(self, slots: list[int]) -> None:
        """Zero `slots` in every layer: a sequence's start."""
        if not slots:
            return
        for fields in self.tensors.values():
            for t in fields.values():
                t.index_fill_(0, torch.tensor(slots, device=t.device), 0)

    def read(self, layer_id: int, index_N: torch.Tensor):
        """The states of slots `index_N` in layer `layer_id`, as a batch of N sequences (its layout's class)."""
        fields = {name: t.index_select(0, index_N) for name, t in self.tensors[layer_id].items()}
        return self.layouts[layer_id].kind(**fields)

    def write(self, layer_id: int, index_N: torch.Tensor, state) -> None:
        """Keep a batch of N sequences' states in slots `index_N`."""
        for name, t in self.tensors[layer_id].items():
            t.index_copy_(0, index_N, getattr(state, name).to(t.dtype))


class StateSlots:
    """Which request owns which slot (the driver's side; module docstring)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner: dict[str, int] = {}

    def slot(self, request_id: str) -> int:
        """`request_id`'s slot, taken from the free ones the first time it runs."""
        if request_id not in self.owner:
            if not self.free:
                raise RuntimeError(f"no recurrent-state slot is free for request {request_id!r}: "
                                   f"{len(self.owner)} sequences hold them all")
            self.owner[request_id] = self.free.pop()
        return self.owner[request_id]

    def release(self, request_ids: list[str]) -> None:
        """Give back the slots of finished, aborted and preempted requests."""
        for rid in request_ids:
            slot = self.owner.pop(rid, None)
            if slot is not None:
                self.free.append(slot)


def refuse_unsupported(cfg: ModelConfig, config) -> None:
    """ConfigError naming the engine setting (`EngineConfig`) that a hybrid model cannot be served
    with (module docstring); nothing for a model without linear-attention layers."""
    if not is_hybrid(cfg):
        return
    what = f"model.family={cfg.family} has recurrent layers {list(state_layouts(cfg))}"
    refused = [
        (config.has_kv_tiers, f"kv_offload_gib={config.kv_offload_gib}, kv_cache_dir={config.kv_cache_dir}",
         "the KV tiers move attention blocks only, not recurrent states; leave them off"),
        (config.kv_role is not None, f"kv_role={config.kv_role}",
         "disaggregated prefill hands over attention blocks only, not recurrent states"),
        (bool(config.system_prompts), "system_prompts",
         "pinned prefixes do not keep their recurrent-state snapshots"),
    ]
    for bad, setting, why in refused:
        if bad:
            raise ConfigError(f"{setting} is invalid for this model: {what}, and {why}")


def prefix_caching(cfg: ModelConfig, enabled: bool, num_snapshots: int = 0) -> bool:
    """Whether the engine reuses cached prompt prefixes: for a hybrid model, whose recurrent state
    after a prefix cannot be rebuilt from the prefix's KV blocks, only with room for state snapshots
    (state_snapshots.py; said once in the log when there is none)."""
    if enabled and is_hybrid(cfg) and num_snapshots == 0:
        log.info("prefix caching is off: model.family=%s keeps a recurrent state per sequence, and the KV budget "
                 "holds no snapshot of it", cfg.family)
        return False
    return enabled
