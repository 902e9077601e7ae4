"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, Gated Delta Networks) in two equal forms,
and the short causal depthwise convolution in front of it.

Per head, a state S [dk, dv] maps keys to values. At step t, with log-decay g_t <= 0 and write
strength beta_t in (0, 1):

    S <- exp(g_t) S                               (forget)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        (delta rule: write the error of S's own guess)
    o_t = S^T q_t

`recurrent_delta_rule` runs that loop token by token: what decoding one token costs. `chunked_delta_rule`
computes the same outputs and final state a chunk of C tokens at a time: inside a chunk, the C
writes solve one unit lower-triangular system (the WY / UT form; its inverse as a product of
log2(C) factors, `unit_lower_inverse`), so the work is matrix products,
and only the chunk count is sequential. Within a chunk with start state S0, cumulative log-decay
c_i = g_1 + ... + g_i and the matrix A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i):

    (I + A) delta = beta v - (beta exp(c) k) S0      so  delta = U - W S0,  U = T beta v,  W = T beta exp(c) k
    o_i = exp(c_i) q_i S0 + sum_{j <= i} exp(c_i - c_j) (q_i.k_j) delta_j
    S_C = exp(c_C) S0 + sum_j exp(c_C - c_j) k_j delta_j^T,        T = (I + A)^-1

Kimi delta attention (KDA) decays each key channel of the state by its own rate: g_t [K] per
head instead of one number, exp(g_t) scaling the state's rows. Both forms take either: a log-decay
[B, S, H] (Gated DeltaNet) or [B, S, H, K] (KDA). Per channel, exp(c_i - c_j) no longer factors out
of k_i.k_j and q_i.k_j, so the chunk's score matrices sum over K with each channel's own decay:
`decayed_products`, a product per sub-block through its last row's decay and the diagonal sub-blocks
whole (computed a few chunks at a time to bound their memory).

Both compute in fp32 and return the output in the input's dtype with the fp32 final state.
Shapes: B batch, S sequence, H heads, K key dim, V value dim, C channels, W conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 elements of the [C, SUB_BLOCK, K] decay terms computed at once when the decay is per channel
PER_CHANNEL_TERMS = 1 << 24
SUB_BLOCK = 8  # rows of a chunk's diagonal blocks whose per-channel decays are taken whole (decayed_products)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the eps inside the root, as fla has it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x_BCS: torch.Tensor, weight_CW: torch.Tensor, state_BCw: torch.Tensor | None,
                bias_C: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of each channel over time (plus `bias`, Mamba-2's), then SiLU: output
    position t reads inputs t-W+1..t, the ones before this call coming from `state` (the last W-1 inputs
    of the previous call; zeros at a sequence's start). Returns (output [B, C, S], the new state [B, C, W-1])."""
    B, C, _ = x_BCS.shape
    W = weight_CW.shape[-1]
    if state_BCw is None:
        state_BCw = x_BCS.new_zeros(B, C, W - 1)
    full = torch.cat([state_BCw.to(x_BCS.dtype), x_BCS], dim=-1)
    bias = None if bias_C is None else bias_C.to(x_BCS.dtype)
    out = F.conv1d(full, weight_CW.unsqueeze(1).to(x_BCS.dtype), bias, groups=C)
    return F.silu(out), full[:, :, full.shape[-1] - (W - 1):]


def _prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """fp32 [B, H, S, .] views: q and k L2-normalised, q also scaled by K^-0.5."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    return (t.transpose(1, 2).contiguous() for t in (q, k, v.float(), g.float(), beta.float()))


def _initial(state: torch.Tensor | None, B: int, H: int, K: int, V: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(B, H, K, V, device=device) if state is None else state.float()


def recurrent_delta_rule(q_BSHK: torch.Tensor, k_BSHK: torch.Tensor, v_BSHV: torch.Tensor, g_BSH: torch.Tensor,
                         beta_BSH: torch.Tensor, state_BHKV: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (module docstring): (output [B, S, H, V], final state).
    `g` is [B, S, H] (one decay per head) or [B, S, H, K] (one per key channel)."""
    B, S, H, K = q_BSHK.shape
    V = v_BSHV.shape[-1]
    q, k, v, g, beta = _prepared(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    state = _initial(state_BHKV, B, H, K, V, q.device)
    out = q.new_empty(B, H, S, V)
    per_channel = g.dim() == 4
    for t in range(S):
        decay = g[:, :, t].exp()
        state = state * (decay[..., None] if per_channel else decay[..., None, None])
        guess = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = (v[:, :, t] - guess) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out.transpose(1, 2).to(v_BSHV.dtype), state


def chunked_delta_rule(q_BSHK: torch.Tensor, k_BSHK: torch.Tensor, v_BSHV: torch.Tensor, g_BSH: torch.Tensor,
                       beta_BSH: torch.Tensor, state_BHKV: torch.Tensor | None = None, chunk: int = 64
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule `chunk` tokens at a time (module docstring). Every chunk's own terms are
    computed at once; only the state passes from chunk to chunk. The sequence is padded to whole
    chunks with tokens that write nothing (beta = 0, k = 0) and do not decay (g = 0). Equal to
    `recurrent_delta_rule`: (output [B, S, H, V], final state)."""
    B, S, H, K = q_BSHK.shape
    V = v_BSHV.shape[-1]
    q, k, v, g, beta = _prepared(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    state = _initial(state_BHKV, B, H, K, V, q.device)
    C = min(chunk, S)
    pad = -S % C
    per_channel = g.dim() == 4
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad) if per_channel else (0, pad)), F.pad(beta, (0, pad))
    N = (S + pad) // C
    q, k, v = (t.reshape(B, H, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, C, *g.shape[3:]), beta.reshape(B, H, N, C)
    # chunks whose own terms are computed together: all of them for a per-head decay, few per channel
    slab = max(1, PER_CHANNEL_TERMS // (B * H * C * SUB_BLOCK * K)) if per_channel else N
    out = q.new_empty(B, H, N, C, V)
    for first in range(0, N, slab):
        part = slice(first, first + slab)
        U, W, scores, q_decayed, k_to_end, chunk_decay = _chunk_terms(q[:, :, part], k[:, :, part], v[:, :, part],
                                                                      g[:, :, part], beta[:, :, part])
        for n in range(U.shape[2]):
            delta = U[:, :, n] - W[:, :, n] @ state  # [B, H, C, V]
            out[:, :, first + n] = q_decayed[:, :, n] @ state + scores[:, :, n] @ delta
            state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ delta
    out = out.reshape(B, H, N * C, V)[:, :, :S]
    return out.transpose(1, 2).to(v_BSHV.dtype), state


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 of strictly lower-triangular matrices A [..., C, C]. A is nilpotent (A^C = 0), so
    the inverse is the finite series sum_n (-A)^n = (I - A)(I + A^2)(I + A^4)...: log2(C) pairs of
    batched products (a batched triangular solve is one slow loop per matrix on CPU)."""
    C = A.shape[-1]
    power = -A
    inverse = torch.eye(C, dtype=A.dtype, device=A.device) + power
    span = 2
    while span < C:
        power = power @ power
        inverse = inverse + inverse @ power
        span *= 2
    return inverse


def decayed_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """M [..., C, C] with M_ij = sum_k a_ik b_jk exp(c_ik - c_jk) for j <= i, 0 above, from a [..., C, K]
    (leading dimensions broadcast with b's: several a at once share the decays), b and a cumulative
    log-decay c [..., C, K] that falls along C. Sub-blocks of SUB_BLOCK columns: below a column block
    J, exp(c_i - c_j) = exp(c_i - c_r) exp(c_r - c_j) with r J's last row, both factors <= 1 (no
    overflow however strong the decay), so the block is one product; on the diagonal blocks the
    [SUB, SUB, K] decays are taken whole."""
    C = a.shape[-2]
    out = a.new_zeros(*a.shape[:-1], C)
    for start in range(0, C, SUB_BLOCK):
        stop = min(start + SUB_BLOCK, C)
        a_d, b_d, c_d = a[..., start:stop, :], b[..., start:stop, :], c[..., start:stop, :]
        if stop < C:
            r = c[..., stop - 1:stop, :]
            left = a[..., stop:, :] * (c[..., stop:, :] - r).exp()
            out[..., stop:, start:stop] = left @ (b_d * (r - c_d).exp()).transpose(-1, -2)
        n = stop - start
        below = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
        decay = (c_d[..., :, None, :] - c_d[..., None, :, :]).masked_fill(~below[..., None], float("-inf")).exp()
        # row i: (b_j exp(c_i - c_j))_j [n, K] times a_i [K]
        out[..., start:stop, start:stop] = ((b_d[..., None, :, :] * decay) @ a_d[..., :, :, None]).squeeze(-1)
    return out


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """What each chunk [B, H, N, C, .] needs of itself (module docstring's notation): U and W (the
    writes as U - W S0), the decayed scores q_i.k_j (j <= i), q_i exp(c_i), k_j exp(c_C - c_j) and
    exp(c_C) as the state's row scale ([B, H, N, 1, 1] per head, [B, H, N, K, 1] per channel)."""
    C = q.shape[-2]
    before = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    kb = k * beta[..., None]
    if g.dim() == q.dim() - 1:  # one decay per head: exp(c_i - c_j) scales whole dot products
        c = g.cumsum(dim=-1)  # [B, H, N, C]
        decay_ij = (c[..., :, None] - c[..., None, :]).masked_fill(~before, float("-inf")).exp()
        A = (kb @ k.transpose(-1, -2)) * decay_ij
        scores = (q @ k.transpose(-1, -2)) * decay_ij
        c = c[..., None]  # [B, H, N, C, 1]
    else:  # one per key channel: each channel's decay inside the sums over K
        c = g.cumsum(dim=-2)  # [B, H, N, C, K]
        A, scores = decayed_products(torch.stack([kb, q]), k, c)  # A's diagonal: dropped by tril(-1) below
    T = unit_lower_inverse(A.tril(-1))
    U = T @ (v * beta[..., None])
    W = T @ (kb * c.exp())
    last = c[..., -1:, :]  # [B, H, N, 1, 1 or K]
    return U, W, scores, q * c.exp(), k * (last - c).exp(), last.exp().transpose(-1, -2)
