"""Mamba-2's state space duality (Dao & Gu 2024, SSD) in two equal forms: token by token for
decoding, a chunk of tokens at a time for training and prompts.

Per head h, a state S [P, N] (head dim x state size) is decayed and written at each step t, with
step size dt_t > 0 and the head's negative rate A:

    S <- exp(dt_t A) S + dt_t x_t B_t^T            (B_t, C_t [N]: the head's group's input-dependent maps)
    y_t = S C_t + D x_t

`recurrent_ssd` runs that loop: what decoding one token costs. `chunked_ssd` computes the same
outputs and final state C tokens at a time. Within a chunk with start state S0 and cumulative
log-decay c_i = dt_1 A + ... + dt_i A:

    y_i = exp(c_i) S0 C_i + sum_{j <= i} exp(c_i - c_j) (C_i . B_j) dt_j x_j + D x_i
    S_C = exp(c_C) S0 + sum_j exp(c_C - c_j) dt_j x_j B_j^T

so each chunk's own terms are matrix products (an attention-like C x C score matrix masked by the
decays), and only the state passes from chunk to chunk. Both compute in fp32 and return the output
in x's dtype with the fp32 final state. dt is softplus(dt_raw + dt_bias), clamped below at `dt_min`
(Mamba-2's time-step limit, applied in both forms).
Shapes: B batch, S sequence, H heads, P head dim, G groups (H / G consecutive heads share one),
N state size, L chunk length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def step_sizes(dt_BSH: torch.Tensor, dt_bias_H: torch.Tensor, dt_min: float) -> torch.Tensor:
    """fp32 dt [B, S, H]: softplus(dt + bias), at least dt_min."""
    return F.softplus(dt_BSH.float() + dt_bias_H.float()).clamp(min=dt_min)


def _per_head(t_BSGN: torch.Tensor, H: int) -> torch.Tensor:
    """B or C [B, S, G, N] -> fp32 [B, S, H, N]: each group's map repeated for its H / G heads."""
    return t_BSGN.float().repeat_interleave(H // t_BSGN.shape[2], dim=2)


def _initial(state: torch.Tensor | None, B: int, H: int, P: int, N: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(B, H, P, N, device=device) if state is None else state.float()


def recurrent_ssd(x_BSHP: torch.Tensor, dt_BSH: torch.Tensor, A_H: torch.Tensor, B_BSGN: torch.Tensor,
                  C_BSGN: torch.Tensor, D_H: torch.Tensor, state_BHPN: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD token by token (module docstring), dt already a step size: (y [B, S, H, P], final state)."""
    Bn, S, H, P = x_BSHP.shape
    x, dt = x_BSHP.float(), dt_BSH.float()
    Bm, Cm = _per_head(B_BSGN, H), _per_head(C_BSGN, H)
    state = _initial(state_BHPN, Bn, H, P, Bm.shape[-1], x.device)
    decay = (dt * A_H.float()).exp()  # [B, S, H]
    out = x.new_empty(Bn, S, H, P)
    for t in range(S):
        write = (x[:, t] * dt[:, t, :, None])[..., None] * Bm[:, t, :, None, :]  # [B, H, P, N]
        state = state * decay[:, t, :, None, None] + write
        out[:, t] = torch.einsum("bhpn,bhn->bhp", state, Cm[:, t])
    out = out + x * D_H.float()[:, None]
    return out.to(x_BSHP.dtype), state


def chunked_ssd(x_BSHP: torch.Tensor, dt_BSH: torch.Tensor, A_H: torch.Tensor, B_BSGN: torch.Tensor,
                C_BSGN: torch.Tensor, D_H: torch.Tensor, state_BHPN: torch.Tensor | None = None, chunk: int = 128
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD `chunk` tokens at a time (module docstring). The sequence is padded to whole chunks with
    steps of dt = 0 (no decay, no write). The scores C_i . B_j are computed once per group and shared
    by its heads (views [B, G, R, ...], R = H / G heads per group). Equal to `recurrent_ssd`:
    (y [B, S, H, P], final state)."""
    Bn, S, H, P = x_BSHP.shape
    G, N = B_BSGN.shape[2], B_BSGN.shape[3]
    R = H // G
    x, dt = x_BSHP.float(), dt_BSH.float()
    state = _initial(state_BHPN, Bn, H, P, N, x.device).view(Bn, G, R, P, N)
    L = min(chunk, S)
    pad = -S % L

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, S, K, E] -> [B, K, n, L, E], padded
        return F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(Bn, t.shape[2], -1, L, t.shape[-1])

    xdt = chunks(x * dt[..., None]).view(Bn, G, R, -1, L, P)
    Bm, Cm = chunks(B_BSGN.float())[:, :, None], chunks(C_BSGN.float())[:, :, None]  # [B, G, 1, n, L, N]
    c = F.pad(dt * A_H.float(), (0, 0, 0, pad)).transpose(1, 2).reshape(Bn, G, R, -1, L).cumsum(dim=-1)
    before = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # j <= i
    decay_ij = (c[..., :, None] - c[..., None, :]).masked_fill(~before, float("-inf")).exp()
    inside = ((Cm @ Bm.transpose(-1, -2)) * decay_ij) @ xdt  # [B, G, R, n, L, P]: the chunk's own writes
    # the decays scale the [L, P] sides (reads of the start state by row, writes carried to the chunk's
    # end by row), so B and C stay one per group
    read_decay, write_decay = c.exp()[..., None], (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, G, R, n, 1, 1]
    out = torch.empty_like(inside)
    for n in range(xdt.shape[3]):
        out[:, :, :, n] = inside[:, :, :, n] + (Cm[:, :, :, n] @ state.transpose(-1, -2)) * read_decay[:, :, :, n]
        writes = (xdt[:, :, :, n] * write_decay[:, :, :, n]).transpose(-1, -2) @ Bm[:, :, :, n]
        state = state * chunk_decay[:, :, :, n] + writes
    out = out.reshape(Bn, H, -1, P)[:, :, :S].transpose(1, 2) + x * D_H.float()[:, None]
    return out.to(x_BSHP.dtype), state.reshape(Bn, H, P, N)
