"""One engine step's view of the recurrent-state slots: what a hybrid model's recurrent layers
read and write during a packed forward (`infer/scheduling/recurrent_state.py` holds the slots).

The step's tokens are packed into one row [1, T, D] (paged_attention.py); a recurrent layer (Gated
DeltaNet, Mamba-2) must run each sequence's tokens from that sequence's own state.
`mix_recurrent(layer_id, mix, x)` does it for the layer (the model's seam: `GatedDeltaNet.forward` and
`Mamba2Mixer.forward` hand over their `mix`): the single-token
items (decodes) run as one batch of N sequences, their states gathered from their slots and scattered
back, the recurrent form; each longer item (a prompt chunk) runs alone from its slot's state, the
chunked form, and leaves its state there for the next chunk. An item without a slot (the engine's
scoring of given tokens) runs from a zero state and keeps nothing, so it must start at position 0.

Prefix caching (scheduling/state_snapshots.py): an item whose `state_from` names a snapshot starts
its slot from it (a sequence that adopted a cached prefix), and an item with `snapshots` runs in
pieces cut at those offsets (block boundaries), keeping the state after each piece in its snapshot;
a decode that completes a block keeps its new state there too.

An item with speculative drafts to verify (`Segment.drafts`) runs token by token, the recurrent form,
keeping the state after each of its tokens; nothing is written to its slot until the verification
says how many drafts were accepted: `commit(slot, kept)` writes the state after its first `kept`
tokens (rolling back is choosing a kept state, not recomputing).

`StatefulStep` is the step's cache: the attention batch's `attend` and everything else it has, plus
`mix_recurrent`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config.errors import ModelError
from tessera.infer.scheduling.recurrent_state import RecurrentStatePool

# A recurrent layer's state (DeltaNetState, Mamba2State: its layout, models/linear_attention/states.py)
State = Any
# (x [B, S, D], state or None) -> (output [B, S, D'], the state after the last token)
Mix = Callable[[torch.Tensor, State | None], tuple[torch.Tensor, State]]


@dataclass(frozen=True)
class Segment:
    """One item of the step: packed rows [row, row + length), its slot (-1: none), its start position."""

    row: int
    length: int
    slot: int
    start: int
    drafts: int = 0  # speculative tokens at its end, to be verified before its state is kept
    state_from: int = -1  # the prefix-cache snapshot its slot starts from, -1 for none
    snapshots: tuple[tuple[int, int], ...] = ()  # (offset, snapshot): keep the state after its first offset tokens


class RecurrentStep:
    """The step's segments over `pool` (module docstring)."""

    def __init__(self, pool: RecurrentStatePool, segments: list[Segment], device: torch.device):
        for s in segments:
            if s.slot < 0 and s.start > 0:
                raise ModelError(f"a hybrid model's tokens at positions {s.start}.. need the recurrent state of the "
                                 "positions before them, which only a running request's slot keeps")
        pool.reset([s.slot for s in segments if s.slot >= 0 and s.start == 0])
        restored = [s for s in segments if s.slot >= 0 and s.state_from >= 0]
        for layer_id in pool.layers:  # a prefix-cache hit: the slot starts from the snapshot at its start
            pool.copy(layer_id, [pool.snapshot_index(s.state_from) for s in restored], [s.slot for s in restored])
        self.pool = pool
        self.decodes = decodes = [s for s in segments if s.length == 1 and s.slot >= 0]
        self.decode_rows = torch.tensor([s.row for s in decodes], dtype=torch.long, device=device)
        self.decode_slots = torch.tensor([s.slot for s in decodes], dtype=torch.long, device=device)
        self.chunks = [(s, torch.tensor([s.slot], device=device)) for s in segments if s not in decodes]
        # slot -> layer -> the state after each of a speculative item's tokens, until `commit`
        self.pending: dict[int, dict[int, list[State]]] = {s.slot: {} for s in segments if s.drafts}

    def mix_recurrent(self, layer_id: int, mix: Mix, x_1TD: torch.Tensor) -> torch.Tensor:
        """The layer's output [1, T, D'] over the packed step, each sequence from its own state."""
        out_1TD = None
        if len(self.decode_rows):
            x_N1D = x_1TD[0].index_select(0, self.decode_rows)[:, None]
            y_N1D, state = mix(x_N1D, self.pool.read(layer_id, self.decode_slots))
            self.pool.write(layer_id, self.decode_slots, state)
            out_1TD = y_N1D.new_empty(1, x_1TD.shape[1], y_N1D.shape[-1])
            out_1TD[0].index_copy_(0, self.decode_rows, y_N1D[:, 0])
            kept = [(s.slot, k) for s in self.decodes for _, k in s.snapshots]
            if kept:  # a decode that completed a block: its state is that block's snapshot
                self.pool.copy(layer_id, [a for a, _ in kept], [self.pool.snapshot_index(k) for _, k in kept])
        for s, index in self.chunks:
            state = self.pool.read(layer_id, index) if s.slot >= 0 else None
            if s.drafts:
                y = self._each_token(layer_id, mix, x_1TD[:, s.row:s.row + s.length], s.slot, state)
            else:
                y, state = self._pieces(layer_id, mix, x_1TD[:, s.row:s.row + s.length], state, s.snapshots)
            if s.slot >= 0 and not s.drafts:
                self.pool.write(layer_id, index, state)
            if out_1TD is None:
                if len(self.chunks) == 1 and s.length == x_1TD.shape[1]:
                    return y
                out_1TD = y.new_empty(1, x_1TD.shape[1], y.shape[-1])
            out_1TD[:, s.row:s.row + s.length] = y
        return out_1TD

    def _pieces(self, layer_id: int, mix: Mix, x_1SD: torch.Tensor, state: State | None,
                snapshots: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, State]:
        """An item's output and final state, run in pieces cut at its snapshots' offsets (block
        boundaries), each snapshot keeping the state after its piece."""
        if not snapshots:
            return mix(x_1SD, state)
        outputs, at = [], 0
        for end, k in snapshots:
            y, state = mix(x_1SD[:, at:end], state)
            self.pool.write(layer_id, torch.tensor([self.pool.snapshot_index(k)], device=x_1SD.device), state)
            outputs.append(y)
            at = end
        if at < x_1SD.shape[1]:
            y, state = mix(x_1SD[:, at:], state)
            outputs.append(y)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), state

    def _each_token(self, layer_id: int, mix: Mix, x_1SD: torch.Tensor, slot: int,
                    state: State) -> torch.Tensor:
        """A speculative item's output, token by token, keeping the state after each (module docstring)."""
        kept, outputs = [], []
        for t in range(x_1SD.shape[1]):
            y, state = mix(x_1SD[:, t:t + 1], state)
            outputs.append(y)
            kept.append(state)
        self.pending[slot][layer_id] = kept
        return torch.cat(outputs, dim=1)

    def commit(self, slot: int, kept: int) -> None:
        """Keep in `slot` the state after the first `kept` tokens of its speculative item (its verified
        tokens: the one it decoded and the accepted drafts)."""
        index = torch.tensor([slot], device=self.decode_slots.device)
        for layer_id, states in self.pending.pop(slot).items():
            self.pool.write(layer_id, index, states[kept - 1])


class StatefulStep:
    """The cache a hybrid model's packed forward gets: `attention` (a `PagedAttentionBatch`) for its
    attention layers, `states` for its linear-attention layers."""

    def __init__(self, attention, states: RecurrentStep):
        self._attention, self._states = attention, states

    def mix_recurrent(self, layer_id: int, mix: Mix, x_1TD: torch.Tensor) -> torch.Tensor:
        return self._states.mix_recurrent(layer_id, mix, x_1TD)

    def __getattr__(self, name: str):
        return getattr(self._attention, name)
