"""The recurrent mixers' state handed on from one part of a sequence to the next, when a sequence is
cut into parts that run apart (context parallelism: each cp rank holds its own parts) and every part
must start from the state the part before it ended with.

Both recurrences are affine in their start state S0, so a part's end state is T(S0) + E, where E is
the end state from a zero start and T the part's transition: a [K, K] matrix acting on the delta
state's rows for the gated delta rule (each step is S <- (I - beta k k^T) diag(exp(g)) S + beta k v^T,
the same on every value column), a number per head for SSD (S <- exp(dt A) S + dt x B^T). Each part
computes (T, E) over its own tokens alone, the parts exchange them, and each part's true start state
is the scan S_0 = 0, S_{j+1} = T_j(S_j) + E_j over the parts in sequence order (`StateHandoff`,
filled by tessera/parallel/context_parallel_recurrent.py); the outputs are then corrected by the start
state's share, which is linear in it too:

- the delta rule runs once over value columns [v | 0] from the start state [0 | I]: its final state is
  [E | T] and its output [o_0 | r], where o_0 is the output from a zero start and r_t = P_t^T q_t (P_t
  the transition up to token t), so the output from S0 is o_0 + S0^T r_t;
- SSD runs from a zero start; the output from S0 adds exp(c_t) S0 C_t (c_t the cumulative log-decay
  up to token t), and T is exp(c) of the part's last token.

The short causal convolution before either recurrence needs the previous part's last W-1 inputs; the
handoff gives them (`previous_inputs`). Gradients flow back through the exchanged (T, E) and inputs to
the parts (and ranks) they came from.
Shapes: b rows (a part of each sequence per row), S the part's tokens, H heads, K key dim, V value
dim, P head dim, N state size, C channels, w = W - 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tessera.models.linear_attention.delta_rule import chunked_delta_rule
from tessera.models.linear_attention.ssd import chunked_ssd

# (the part's transition, the state before it) -> the transition applied to that state
Apply = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StateHandoff(Protocol):
    """What a recurrent mixer asks of the parts of its sequences held elsewhere. `fold` puts this
    rank's parts of each sequence [B, tokens, D] as rows [b, S, D] (each row one part), `unfold` puts
    them back; `previous_inputs` returns each row's previous part's last w inputs [b, C, w] (zeros for
    a sequence's first part) from every row's last w inputs; `start_states` returns each row's start
    state from every row's (transition, zero-start end state) and how a transition applies."""

    def fold(self, x_BSD: torch.Tensor) -> torch.Tensor: ...

    def unfold(self, y_bSD: torch.Tensor) -> torch.Tensor: ...

    def previous_inputs(self, last_bCw: torch.Tensor) -> torch.Tensor: ...

    def start_states(self, transition: torch.Tensor, end: torch.Tensor, apply: Apply) -> torch.Tensor: ...


def in_sequence_order(handoff: StateHandoff | None, y_bSE: torch.Tensor) -> torch.Tensor:
    """A mixer's output rows before its output projection, put back as whole sequences [B, tokens, E] under
    a handoff (`unfold`), as they are without one. The projection runs on the sequences, not the parts:
    under sequence parallelism its output is reduce-scattered along the tokens, and each tp rank must get
    its share of the sequence in order, not of every part."""
    return y_bSE if handoff is None else handoff.unfold(y_bSE)


def _left_product(T_bHKK: torch.Tensor, S_bHKV: torch.Tensor) -> torch.Tensor:
    return T_bHKK @ S_bHKV


def _scale(T_bH11: torch.Tensor, S_bHPN: torch.Tensor) -> torch.Tensor:
    return T_bH11 * S_bHPN


def handed_on_delta_rule(q_bSHK: torch.Tensor, k_bSHK: torch.Tensor, v_bSHV: torch.Tensor, g: torch.Tensor,
                         beta_bSH: torch.Tensor, chunk: int, handoff: StateHandoff
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over this row's part, started from the state the previous part
    hands on (module docstring): (output [b, S, H, V] in v's dtype, the part's fp32 end state)."""
    b, S, H, K = q_bSHK.shape
    V = v_bSHV.shape[-1]
    columns = torch.cat([v_bSHV.float(), v_bSHV.new_zeros(b, S, H, K, dtype=torch.float32)], dim=-1)
    eye = torch.eye(K, device=q_bSHK.device).expand(b, H, K, K)
    start = torch.cat([eye.new_zeros(b, H, K, V), eye], dim=-1)
    out, final = chunked_delta_rule(q_bSHK, k_bSHK, columns, g, beta_bSH, start, chunk=chunk)
    end, transition = final.split([V, K], dim=-1)
    S0 = handoff.start_states(transition, end, _left_product)  # [b, H, K, V]
    out = out[..., :V] + torch.einsum("bshk,bhkv->bshv", out[..., V:], S0)
    return out.to(v_bSHV.dtype), transition @ S0 + end


def handed_on_ssd(x_bSHP: torch.Tensor, dt_bSH: torch.Tensor, A_H: torch.Tensor, B_bSGN: torch.Tensor,
                  C_bSGN: torch.Tensor, D_H: torch.Tensor, chunk: int, handoff: StateHandoff
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD over this row's part, started from the state the previous part hands on (module
    docstring): (y [b, S, H, P] in x's dtype, the part's fp32 end state)."""
    H = x_bSHP.shape[2]
    y, end = chunked_ssd(x_bSHP.float(), dt_bSH, A_H, B_bSGN, C_bSGN, D_H, None, chunk=chunk)
    c = (dt_bSH.float() * A_H.float()).cumsum(dim=1)  # [b, S, H]
    transition = c[:, -1].exp()[..., None, None]  # [b, H, 1, 1]
    S0 = handoff.start_states(transition, end, _scale)  # [b, H, P, N]
    C = C_bSGN.float().repeat_interleave(H // C_bSGN.shape[2], dim=2)  # [b, S, H, N]
    y = y + c.exp()[..., None] * torch.einsum("bhpn,bshn->bshp", S0, C)
    return y.to(x_bSHP.dtype), transition * S0 + end
