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

from tessera.models.flops import SSD_SLAB_TERMS

# fp32 elements of a slab's largest terms (its decays [s, H, L, L] or carried writes [s, H, P, N]) at once
SLAB_TERMS = SSD_SLAB_TERMS  # tessera/models/flops.py holds it for the planner
# the most a head may decay (in log) within one chunk for `_shared_decay_slab`: exp(60) ~ 1e26 leaves
# fp32 room for its sums
SPAN_LIMIT = 60.0


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
    """SSD `chunk` tokens at a time (module docstring), a slab of chunks at a time (the slab's terms
    bounded by SLAB_TERMS): `_shared_decay_slab` where no head decays by more than SPAN_LIMIT (in log)
    within a chunk, else `_ssd_slab`. The sequence is padded to whole chunks with steps of dt = 0
    (no decay, no write). Per group, its R = H / G heads' [L, P] sides sit side by side as one [L, R P]
    matrix, so that B and C, one per group, meet all of the group's heads in one product. Equal to
    `recurrent_ssd`: (y [B, S, H, P], final state)."""
    Bn, S, H, P = x_BSHP.shape
    G, N = B_BSGN.shape[2], B_BSGN.shape[3]
    R = H // G
    x, dt = x_BSHP.float(), dt_BSH.float()
    # the state transposed, [B, G, N, R P]: C reads it and B^T writes it as plain products
    state = _initial(state_BHPN, Bn, H, P, N, x.device).view(Bn, G, R * P, N).transpose(-1, -2).contiguous()
    L = min(chunk, S)
    pad = -S % L
    n = (S + pad) // L

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, S, G, E] -> [B, G, n, L, E], padded (a view)
        return F.pad(t, (0, 0, 0, 0, 0, pad)).view(Bn, n, L, G, t.shape[-1]).permute(0, 3, 1, 2, 4)

    xdt = chunks((x * dt[..., None]).view(Bn, S, G, R * P))
    Bm, Cm = chunks(B_BSGN.float()), chunks(C_BSGN.float())
    c = chunks((dt * A_H.float()).view(Bn, S, G, R)).transpose(-1, -2).cumsum(dim=-1)  # [B, G, n, R, L]
    slab = max(1, SLAB_TERMS // (Bn * H * L * max(L, P * N // L)))
    ys = []
    for first in range(0, n, slab):
        part = slice(first, first + slab)
        mild = float(c[:, :, part, :, -1].detach().min()) >= -SPAN_LIMIT  # no head decays by more in a chunk
        y, state = (_shared_decay_slab if mild else _ssd_slab)(xdt[:, :, part], Bm[:, :, part], Cm[:, :, part],
                                                               c[:, :, part], state)
        ys.append(y.permute(0, 2, 3, 1, 4, 5))  # [B, n, L, G, R, P]: the output's own layout
    y = torch.cat(ys, dim=1).view(Bn, n * L, H, P)[:, :S]
    final = state.transpose(-1, -2).reshape(Bn, H, P, N)
    return torch.addcmul(y, x, D_H.float()[:, None]).to(x_BSHP.dtype), final


def _ssd_slab(xdt: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, c: torch.Tensor, state: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A slab of s chunks: y [B, G, s, L, R, P] and the state after them [B, G, N, R P], from xdt
    [B, G, s, L, R P], B and C [B, G, s, L, N], the cumulative log-decays c [B, G, s, R, L] and the
    state before. Each chunk's writes are carried to its end all at once (they read no state); only
    the state's decay-and-add and its read by C pass from chunk to chunk."""
    Bn, G, s, L, RP = xdt.shape
    R = c.shape[3]
    xdt, Bm, Cm = xdt.contiguous(), Bm.contiguous(), Cm.contiguous()
    before = torch.ones(L, L, dtype=torch.bool, device=xdt.device).tril()  # j <= i
    decay_ij = (c[..., :, None] - c[..., None, :]).masked_fill(~before, float("-inf")).exp()  # [B, G, s, R, L, L]
    x_heads = xdt.view(Bn, G, s, L, R, RP // R).transpose(3, 4)  # [B, G, s, R, L, P]
    inside = ((Cm @ Bm.transpose(-1, -2))[:, :, :, None] * decay_ij) @ x_heads  # the chunks' own writes
    last = c[..., -1:]
    to_end = (last - c).exp().transpose(-1, -2)[..., None]  # [B, G, s, L, R, 1]
    writes = Bm.transpose(-1, -2) @ (xdt.view(x_heads.transpose(3, 4).shape) * to_end).view(Bn, G, s, L, RP)
    chunk_decay = last.exp()  # [B, G, s, R, 1]
    reads = []
    for i in range(s):
        reads.append(Cm[:, :, i] @ state)  # [B, G, L, R P]
        scaled = state.view(Bn, G, -1, R, RP // R) * chunk_decay[:, :, i, None]
        state = writes[:, :, i] + scaled.view(state.shape)
    read_decay = c.exp().transpose(-1, -2)[..., None]  # [B, G, s, L, R, 1]
    y = torch.stack(reads, dim=2).view(Bn, G, s, L, R, -1) * read_decay + inside.transpose(3, 4)
    return y, state


def _shared_decay_slab(xdt: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, c: torch.Tensor, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ssd_slab` where no head's decay within a chunk exceeds exp(-SPAN_LIMIT): exp(c_i - c_j) =
    exp(c_i) exp(-c_j) with exp(-c_j) <= exp(SPAN_LIMIT), so the decays leave the L x L matrix (one
    C.B scores matrix per group, shared by its heads) for x's rows (exp(-c_j)) and the output's rows
    (exp(c_i), which also decays the start state's read), and the writes carried to the chunk's end
    are exp(c_L) times the same scaled x."""
    Bn, G, s, L, RP = xdt.shape
    R = c.shape[3]
    xdt, Bm, Cm = xdt.contiguous(), Bm.contiguous(), Cm.contiguous()
    before = torch.ones(L, L, dtype=torch.bool, device=xdt.device).tril()  # j <= i
    decay = c.exp().transpose(-1, -2)[..., None]  # [B, G, s, L, R, 1]
    x_scaled = (xdt.view(Bn, G, s, L, R, -1) / decay).view(xdt.shape)
    inside = (Cm @ Bm.transpose(-1, -2)).masked_fill(~before, 0.0) @ x_scaled  # [B, G, s, L, R P]
    writes = Bm.transpose(-1, -2) @ x_scaled  # [B, G, s, N, R P], before the chunk's decay exp(c_L)
    chunk_decay = c[..., -1:].exp()  # [B, G, s, R, 1]
    reads = []
    for i in range(s):
        reads.append(Cm[:, :, i] @ state)  # [B, G, L, R P]
        state = ((state + writes[:, :, i]).view(Bn, G, -1, R, RP // R) * chunk_decay[:, :, i, None]).view(state.shape)
    y = (torch.stack(reads, dim=2) + inside).view(Bn, G, s, L, R, -1) * decay
    return y, state
