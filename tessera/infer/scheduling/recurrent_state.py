"""The recurrent-state slots of a hybrid model, beside the paged KV cache.

A hybrid decoder's linear-attention layers (Gated DeltaNet, tessera/models/linear_attention) keep
per sequence a fixed-size state instead of keys and values that grow with it: the short
convolution's last W-1 inputs (channels x (W-1), in the engine's dtype) and the delta rule's state
(value heads x key dim x value dim, fp32). The attention layers of the same model keep using the
paged blocks (kv_cache.py).

`RecurrentStatePool` holds, per linear-attention layer, one tensor of `num_slots` such states; a
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
are not kept; tensor-parallel serving does not cut the DeltaNet layers yet.
Shapes: N slots, C convolution channels, W convolution width, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import logging

import torch

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.linear_attention.gated_deltanet import DeltaNetState

log = logging.getLogger("tessera.infer")


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether `cfg` has linear-attention layers (a per-sequence recurrent state)."""
    return cfg.linear_attention is not None and bool(cfg.linear_attention.layers)


def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """((C, W-1), (H, K, V)): one sequence's convolution window and delta state in one layer."""
    la = cfg.linear_attention
    channels = 2 * la.n_key_heads * la.key_head_dim + la.n_value_heads * la.value_head_dim
    return (channels, la.conv_width - 1), (la.n_value_heads, la.key_head_dim, la.value_head_dim)


def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's recurrent state over every linear-attention layer, in bytes."""
    if not is_hybrid(cfg):
        return 0
    (c, w), (h, k, v) = state_shapes(cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    return (c * w * elem + h * k * v * 4) * len(cfg.linear_attention.layers)


class RecurrentStatePool:
    """Per linear-attention layer, `num_slots` convolution windows [N, C, W-1] and delta states
    [N, H, K, V] (fp32), zero until written; after them `num_snapshots` more of each, the prefix
    cache's snapshots (state_snapshots.py)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 num_snapshots: int = 0):
        (c, w), (h, k, v) = state_shapes(cfg)
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        n = num_slots + num_snapshots
        self.layers = list(cfg.linear_attention.layers)
        self.conv = {i: torch.zeros(n, c, w, dtype=dtype, device=device) for i in self.layers}
        self.delta = {i: torch.zeros(n, h, k, v, dtype=torch.float32, device=device) for i in self.layers}
        # every per-layer store of a sequence's state: what reset, copy (snapshots) act on
        self.stores: tuple[dict[int, torch.Tensor], ...] = (self.conv, self.delta)

    def snapshot_index(self, snapshot: int) -> int:
        """Where snapshot `snapshot` lives in the pool's tensors."""
        return self.num_slots + snapshot

    def copy(self, layer_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the states at indices `src` to `dst` in layer `layer_id` (every state the layer keeps)."""
        if not src:
            return
        device = self.delta[layer_id].device
        s, d = (torch.tensor(i, dtype=torch.long, device=device) for i in (src, dst))
        for store in self.stores:
            store[layer_id].index_copy_(0, d, store[layer_id].index_select(0, s))

    def reset(self, slots: list[int]) -> None:
        """Zero `slots` in every layer: a sequence's start."""
        if not slots:
            return
        index = torch.tensor(slots, device=next(iter(self.delta.values())).device)
        for i in self.layers:
            for store in self.stores:
                store[i].index_fill_(0, index, 0)

    def read(self, layer_id: int, index_N: torch.Tensor) -> DeltaNetState:
        """The states of slots `index_N` in layer `layer_id`, as a batch of N sequences."""
        return DeltaNetState(self.conv[layer_id].index_select(0, index_N),
                             self.delta[layer_id].index_select(0, index_N))

    def write(self, layer_id: int, index_N: torch.Tensor, state: DeltaNetState) -> None:
        """Keep a batch of N sequences' states in slots `index_N`."""
        self.conv[layer_id].index_copy_(0, index_N, state.conv.to(self.conv[layer_id].dtype))
        self.delta[layer_id].index_copy_(0, index_N, state.delta.float())


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
    what = f"model.family={cfg.family} has linear-attention layers {cfg.linear_attention.layers}"
    refused = [
        (config.tensor_parallel_size > 1, f"tensor_parallel_size={config.tensor_parallel_size}",
         "tensor-parallel serving does not cut the linear-attention layers yet; use 1"),
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
