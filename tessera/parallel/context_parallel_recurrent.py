"""Context parallelism for the recurrent mixers (Gated DeltaNet, Kimi delta attention, Mamba-2): each cp
rank runs the chunked form over its own tokens only, every part of the sequence starting from the state
the part before it ends with (models/linear_attention/handoff.py says how a part's end state is an affine
function of its start state, and how the outputs are corrected once the start state is known).

`PartHandoff` is the mixers' `handoff` seam under cp. A rank's tokens of a sequence are one part under
the contiguous split (rank r holds part r of cp) and two under the zig-zag one (parts r and 2 cp - 1 - r
of 2 cp, in that order; sequence_layout.py), so the recurrent layers follow whichever split attention
uses and nothing is reordered: each part becomes a row of its own (`fold`). Per layer two all-gathers
over cp, both differentiable (backward: the reduce-scatter of their gradients, so a part's gradient
reaches the rank whose tokens made it): every part's last w convolution inputs (the next part's
convolution reads them), and every part's (transition, end state from a zero start), from which each
rank scans the parts before its own in sequence order to its start states. The exchanged tensors are a
state's size per part, whatever the sequence's length; the scan is cp products of them.
Shapes: B batch, m parts per rank, c tokens per part, b = m B rows, D model dim.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tessera.models.linear_attention.handoff import Apply
from tessera.parallel.collectives import gather_rows_then
from tessera.parallel.sequence_layout import all_rank_positions


class PartHandoff:
    """A recurrent mixer's `handoff` (the `StateHandoff` protocol) on cp rank `cp_rank` of `cp` under
    `layout`. A plain object, not a module, so parameter names and state dicts do not change."""

    def __init__(self, group: ProcessGroup, cp_rank: int, cp: int, layout: str = "contiguous"):
        self.group, self.cp = group, cp
        self.parts = 1 if layout == "contiguous" else 2
        order = all_rank_positions(self.parts, cp, layout)  # [cp, m]: where each rank's parts sit in sequence
        self.row_of = order.flatten().argsort().tolist()  # sequence part -> its row among the gathered parts
        self.mine = order[cp_rank].tolist()  # this rank's parts, in its order

    def fold(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """[B, m c, D] -> [m B, c, D], part by part."""
        return x_BSD.unflatten(1, (self.parts, -1)).transpose(0, 1).flatten(0, 1)

    def unfold(self, y_bcD: torch.Tensor) -> torch.Tensor:
        """[m B, c, D] -> [B, m c, D]: the inverse of `fold`."""
        return y_bcD.unflatten(0, (self.parts, -1)).transpose(0, 1).flatten(1, 2)

    def _in_order(self, every: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's gathered rows [cp m B, ...] as one [B, ...] per part of the sequence, in sequence order."""
        every = every.unflatten(0, (self.cp * self.parts, -1))
        return [every[row] for row in self.row_of]

    def previous_inputs(self, last_bCw: torch.Tensor) -> torch.Tensor:
        """Each of this rank's parts' previous part's last w convolution inputs (zeros for the first part)."""
        def pick(every: torch.Tensor) -> torch.Tensor:
            parts = self._in_order(every)
            return torch.cat([parts[s - 1] if s > 0 else torch.zeros_like(parts[0]) for s in self.mine])

        return gather_rows_then(pick, self.group, last_bCw.contiguous())

    def start_states(self, transition: torch.Tensor, end: torch.Tensor, apply: Apply) -> torch.Tensor:
        """Each of this rank's parts' start state: the scan of every earlier part's (transition, end)."""
        def scan(every_transition: torch.Tensor, every_end: torch.Tensor) -> torch.Tensor:
            transitions, ends = self._in_order(every_transition), self._in_order(every_end)
            state, starts = torch.zeros_like(ends[0]), []
            for s in range(max(self.mine) + 1):
                starts.append(state)
                state = apply(transitions[s], state) + ends[s]
            return torch.cat([starts[s] for s in self.mine])

        return gather_rows_then(scan, self.group, transition.contiguous(), end.contiguous())
