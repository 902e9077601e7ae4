"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, Gated Delta Networks) in two equal forms,
and the short causal depthwise convolution in front of it.

Per head, a state S [dk, dv] maps keys to values. At step t, with log-decay g_t <= 0 and write
strength beta_t in (0, 1):

    S <- exp(g_t) S                               (forget)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        (delta rule: write the error of S's own guess)
    o_t = S^T q_t

`recurrent_delta_rule` runs that loop token by token: what decoding one token costs. `chunked_delta_rule`
computes the same outputs and final state a chunk of C tokens at a time: inside a chunk, the C
writes solve one unit lower-triangular system (the WY / UT form; its inverse T by one batched
triangular solve of all the chunks' systems), so the work is matrix products, and only the chunk
count is sequential. Within a chunk with start state S0, cumulative log-decay
c_i = g_1 + ... + g_i and the matrix A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i):

    (I + A) delta = beta v - (beta exp(c) k) S0      so  delta = U - W S0,  U = T beta v,  W = T beta exp(c) k
    o_i = exp(c_i) q_i S0 + sum_{j <= i} exp(c_i - c_j) (q_i.k_j) delta_j
    S_C = exp(c_C) S0 + sum_j exp(c_C - c_j) k_j delta_j^T,        T = (I + A)^-1

Kimi delta attention (KDA) decays each key channel of the state by its own rate: g_t [K] per
head instead of one number, exp(g_t) scaling the state's rows. Both forms take either: a log-decay
[B, S, H] (Gated DeltaNet) or [B, S, H, K] (KDA). Per channel, exp(c_i - c_j) no longer factors out
of k_i.k_j and q_i.k_j, so the chunk's score matrices sum over K with each channel's own decay: one
product referred to the chunk's first row where no channel decays too fast for fp32 within the chunk
(`_referred_chunk_terms`, whose one exp also gives the chunk's other decays), else `decayed_products`:
one product per block of rows referred to its first row's decay where no channel decays too fast
within a block, else a product per sub-block through its last row's decay with the diagonal
sub-blocks whole.

Both compute in fp32 and return the output in the input's dtype with the fp32 final state.
Shapes: B batch, S sequence, H heads, K key dim, V value dim, C channels, W conv width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.models.flops import (
    DELTA_RULE_PER_CHANNEL_TERMS,
    DELTA_RULE_PER_HEAD_TERMS,
    DELTA_RULE_SUB_BLOCK,
    DELTA_RULE_TILE,
)

# fp32 elements of one slab's terms (a few chunks'): small enough that they are in cache when the chunk loop
# reads them and that malloc reuses their memory from slab to slab instead of mapping fresh pages (at 16 MiB
# slabs a page fault per 4 KiB cost about a fifth of an 8k-token prompt's time). [C, SUB_BLOCK, K] elements a
# chunk when the decay is per channel, [C, K + V] when per head.
PER_CHANNEL_TERMS = DELTA_RULE_PER_CHANNEL_TERMS  # tessera/models/flops.py holds them for the planner
PER_HEAD_TERMS = DELTA_RULE_PER_HEAD_TERMS
# the tokens whose own terms are computed together: a chunk of a whole number of TILEs is computed a tile at
# a time (the same sums, cut where the chunk is cut anyway, so a prompt cut at its chunks computes the same
# tiles); on one CPU thread tiles of 32 ran an 8k-token prompt faster than 64 (less of the chunk's quadratic work)
TILE = DELTA_RULE_TILE  # tessera/models/flops.py counts the chunked form's products by it
# rows of a chunk's diagonal blocks whose per-channel decays are taken whole (_exact_products)
SUB_BLOCK = DELTA_RULE_SUB_BLOCK
# rows of the blocks `_referenced_products` refers to one row, and the most a channel may decay (in log)
# within one for it: exp(60) ~ 1e26 leaves fp32 room for a sum over K of such terms
ROW_BLOCK = 16
SPAN_LIMIT = 60.0
L2_EPS = 1e-6  # inside the root of q's and k's L2 norms, as fla has it

# A kernel computing a slab's chunk terms, no gradients (the seam `fused_chunk_terms` of the mixers;
# tessera/infer/cpu/layer_ops.py fills it with the C++ library's): (q, k, v, g, beta [B, S, H, .], chunk,
# q_scale, eps) -> (qd, W, U, scores, kinv, decay, span), as `_fused_chunk_terms` reads them. Its slabs
# are sized as a decay per head's (PER_HEAD_TERMS): its outputs are [C, K] or [C, V] a chunk either way.
ChunkTerms = Callable[..., tuple[torch.Tensor, ...]]


def l2_factor(x: torch.Tensor, scale: float = 1.0, eps: float = L2_EPS) -> torch.Tensor:
    """scale / sqrt(sum(x^2) + eps) over the last dimension (the eps inside the root, as fla has it):
    what L2-normalises x, kept apart so the product that applies it can also lay x out anew."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps) * scale


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


def _normalized(x_BSHK: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fp32 [B, H, S, K], contiguous: x L2-normalised and scaled (`l2_factor`), the transpose folded into
    the one product (a pass over the prompt-sized tensor each saved)."""
    x = x_BSHK.float()
    factor = l2_factor(x, scale)
    return (factor.transpose(1, 2).contiguous() * x.transpose(1, 2)).contiguous()


def _prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """fp32 [B, H, S, .] views: q and k L2-normalised, q also scaled by K^-0.5."""
    v, g, beta = (t.float().transpose(1, 2).contiguous() for t in (v, g, beta))
    return _normalized(q, q.shape[-1] ** -0.5), _normalized(k), v, g, beta


def _initial(state: torch.Tensor | None, B: int, H: int, K: int, V: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(B, H, K, V, device=device) if state is None else state.float()


def _autocast_off(form):
    """`form` run with autocast off: the recurrence computes in fp32 whatever its caller's autocast (under
    `train.dtype: bf16` the chunk products would otherwise run in bf16, and the state update meet a bf16
    correction and fp32 keys: a dtype error)."""
    @functools.wraps(form)
    def run(q_BSHK: torch.Tensor, *args, **kwargs):
        with torch.autocast(q_BSHK.device.type, enabled=False):
            return form(q_BSHK, *args, **kwargs)

    return run


@_autocast_off
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


@_autocast_off
def chunked_delta_rule(q_BSHK: torch.Tensor, k_BSHK: torch.Tensor, v_BSHV: torch.Tensor, g_BSH: torch.Tensor,
                       beta_BSH: torch.Tensor, state_BHKV: torch.Tensor | None = None, chunk: int = 64,
                       chunk_terms: ChunkTerms | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule `chunk` tokens at a time (module docstring; a chunk of whole TILEs a tile at
    a time), a slab of chunks at a time: each slab's inputs are laid out chunk first ([n, B H, C, .],
    `_in_chunks`) and its own terms computed at once (bounded memory, every product over the slab a
    plain batched one, nothing prompt-sized allocated but the output); only the state passes from
    chunk to chunk. The sequence is padded to whole chunks with tokens that write nothing (beta = 0,
    k = 0) and do not decay (g = 0). Equal to `recurrent_delta_rule`: (output [B, S, H, V], final state).
    `chunk_terms` (a `ChunkTerms` kernel, the seam `fused_chunk_terms` of the mixers) computes each
    slab's chunk terms where no gradient is wanted (`_fused_chunk_terms`); the PyTorch ops otherwise."""
    B, S, H, K = q_BSHK.shape
    V = v_BSHV.shape[-1]
    C = min(chunk, S)
    C = TILE if C % TILE == 0 else C
    state = _initial(state_BHKV, B, H, K, V, q_BSHK.device).reshape(B * H, K, V)
    inputs = (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state)
    in_place = not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))
    if in_place and state_BHKV is not None:
        state = state.clone()  # the caller's, if already fp32
    N, per_channel = -(-S // C), g_BSH.dim() == 4
    fused = chunk_terms if in_place else None
    per_chunk = B * H * C * (SUB_BLOCK * K if per_channel and fused is None else K + V)
    slab = max(1, (PER_CHANNEL_TERMS if per_channel and fused is None else PER_HEAD_TERMS) // per_chunk)
    out = q_BSHK.new_empty(B, N * C, H, V, dtype=torch.float32)
    for first in range(0, N, slab):
        rows = slice(first * C, min(first + slab, N) * C)
        slab_in = [t[:, rows] for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)]
        # (the last slab's terms live until these replace them: the order malloc reuses their memory in)
        fused_terms = None if fused is None else _fused_chunk_terms(fused, slab_in, C)
        if fused_terms is not None:
            terms = fused_terms
        else:
            q, k = _in_chunks(slab_in[0], C, K ** -0.5), _in_chunks(slab_in[1], C, 1.0)
            terms = _chunk_terms(q, k, *(_in_chunks(t, C) for t in slab_in[2:]))
        outs, state = _slab_outputs(state, terms, in_place, fused_terms is not None)
        del fused_terms
        n = outs.shape[0]
        out[:, rows].view(B, n, C, H, V).copy_(outs.view(n, B, H, C, V).permute(1, 0, 3, 2, 4))
    return out[:, :S].to(v_BSHV.dtype), state.reshape(B, H, K, V)


def _slab_outputs(state: torch.Tensor, terms, in_place: bool, decay_after: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A slab's chunks in turn: their outputs [n, BH, C, V] (written where they go when `in_place`)
    and the state after the last."""
    n, V = terms[0].shape[0], terms[2].shape[-1]
    if not in_place:
        outs = []
        for i in range(n):
            chunk_out, state = _chunk_step(state, *(t[i] for t in terms), in_place)
            outs.append(chunk_out)
        return torch.stack(outs), state
    outs = state.new_empty(n, *terms[0].shape[1:-1], V)
    for i in range(n):
        state = _chunk_step(state, *(t[i] for t in terms), in_place, outs[i], decay_after)[1]
    return outs, state


def _fused_chunk_terms(chunk_terms: ChunkTerms, slab: list[torch.Tensor], C: int):
    """`_chunk_terms` of one slab from a `ChunkTerms` kernel. With c referred to the start of each chunk,
    kb = beta k exp(c), vb = beta v: qd = q exp(c), kinv = k exp(-c), decay = exp(c_C), T = (I + kb kinv^T)^-1
    (below the diagonal), W = T kb, U = T vb, the scores tril(qd kinv^T); the state's write is kinv^T delta
    before the decay (`_chunk_step`'s `decay_after`: S_C = exp(c_C) (S0 + sum_j exp(-c_j) k_j delta_j^T)).
    None where some channel decays by more than SPAN_LIMIT within a chunk (exp(-c) would leave fp32's
    room), which the PyTorch ops then take."""
    q, k, v, g, beta = (t.float() for t in slab)
    qd, W, U, scores, kinv, decay, span = chunk_terms(q, k, v, g, beta, C, q.shape[-1] ** -0.5, L2_EPS)
    if float(span) > SPAN_LIMIT:
        return None
    return qd, W, U, scores, kinv.transpose(-1, -2), decay


def _in_chunks(x_BSH_: torch.Tensor, C: int, scale: float | None = None) -> torch.Tensor:
    """fp32 [N, B H, C, ...] contiguous from [B, S, H, ...], padded with zeros to N whole chunks of C;
    with `scale`, each last-dimension vector L2-normalised and scaled (`l2_factor`), the factor and the
    re-layout in one product."""
    B, S, H = x_BSH_.shape[:3]
    x = x_BSH_.float()
    pad = -S % C
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    N = x.shape[1] // C
    order = (1, 0, 3, 2, *range(4, x.dim() + 1))  # [B, N, C, H, ...] -> [N, B, H, C, ...]
    chunked = x.view(B, N, C, H, *x.shape[3:]).permute(order)
    if scale is not None:
        chunked = l2_factor(x, scale).view(B, N, C, H, 1).permute(order).contiguous() * chunked
    return chunked.contiguous().view(N, B * H, C, *x.shape[3:])


def _chunk_step(state: torch.Tensor, q: torch.Tensor, W: torch.Tensor, U: torch.Tensor, scores: torch.Tensor,
                k_t: torch.Tensor, chunk_decay: torch.Tensor, in_place: bool, out: torch.Tensor | None = None,
                decay_after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's output [BH, C, V] (written into `out` where given) and the state after it, from the
    state before it [BH, K, V]; q and k_t carry their decays (exp(c_i), exp(c_C - c_j)) already, or with
    `decay_after` k_t carries exp(-c_j) and the chunk's decay scales the state after its writes.
    `in_place` (no gradient wanted): the state is scaled and written where it is, saving a copy of it per
    chunk, and U (read once) becomes delta where it is."""
    if in_place:
        delta = U.baddbmm_(W, state, alpha=-1)
        out = torch.bmm(q, state) if out is None else torch.bmm(q, state, out=out)
        out.baddbmm_(scores, delta)
        if decay_after:
            return out, state.baddbmm_(k_t, delta).mul_(chunk_decay)
        return out, state.mul_(chunk_decay).baddbmm_(k_t, delta)
    # with gradients, out of place: recompute=op's policy may keep bmm's output, which must stay as it was
    delta = torch.baddbmm(U, W, state, alpha=-1)
    out = torch.baddbmm(torch.bmm(q, state), scores, delta)
    return out, torch.baddbmm(state * chunk_decay, k_t, delta)


def decayed_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """M [..., m, C, C] with M_ij = sum_k a_ik b_jk exp(c_ik - c_jk) for j <= i, 0 above, for each of the
    m matrices a [..., m, C, K] (several a at once share b's decays), b and a cumulative log-decay c
    [..., C, K] that falls along C. Where no channel decays by more than SPAN_LIMIT within any
    ROW_BLOCK rows, `_referenced_products`; else `_exact_products`."""
    C = c.shape[-2]
    first = torch.arange(0, C, ROW_BLOCK, device=c.device)
    span = c[..., first, :] - c[..., (first + ROW_BLOCK - 1).clamp(max=C - 1), :]
    if float(span.detach().max()) <= SPAN_LIMIT:
        return _referenced_products(a, b, c)
    return _exact_products(a, b.unsqueeze(-3), c.unsqueeze(-3))


def _referenced_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`decayed_products` by row blocks of ROW_BLOCK, each referred to its first row r: exp(c_i - c_j)
    = exp(c_i - c_r) exp(c_r - c_j), the first factor <= 1, the second <= 1 left of the block and at
    most exp(SPAN_LIMIT) inside it, so each block's rows (of all m a's, stacked) are one product with
    all columns up to its end (those above the diagonal then zeroed)."""
    *lead, m, C, K = a.shape
    out = a.new_zeros(*lead, m, C, C)
    for start in range(0, C, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, C)
        ref = c[..., start:start + 1, :]
        left = a[..., start:stop, :] * (c[..., start:stop, :] - ref).exp().unsqueeze(-3)  # [..., m, rows, K]
        right = b[..., :stop, :] * (ref - c[..., :stop, :]).exp()
        rows = left.reshape(*lead, m * (stop - start), K) @ right.transpose(-1, -2)
        out[..., start:stop, :stop] = rows.view(*lead, m, stop - start, stop)
    return out.tril()


def _exact_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`decayed_products` for any decay: sub-blocks of SUB_BLOCK columns: below a column block
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
    """What each chunk [n, BH, C, .] needs of itself (module docstring's notation), as `_chunk_step`
    reads it: q exp(c), W and U (the writes being U - W S0), the decayed scores q_i.k_j (j <= i),
    (k exp(c_C - c))^T [K, C] and exp(c_C) as the state's row scale ([1, 1] per head, [K, 1] per
    channel). T = (I + A)^-1 by one batched triangular solve against I (A's diagonal and upper half
    unread); beta scales T's columns."""
    if g.dim() == q.dim() - 1:  # one decay per head: exp(c_i - c_j) scales whole dot products
        C = q.shape[-2]
        before = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
        c = g.cumsum(dim=-1)  # [n, BH, C]
        decay_ij = (c[..., :, None] - c[..., None, :]).masked_fill(~before, float("-inf")).exp()
        k_t = k.transpose(-1, -2)
        A, scores = (k @ k_t) * (decay_ij * beta[..., None]), (q @ k_t) * decay_ij
        read_decay, to_end = c[..., None].exp(), (c[..., -1:] - c)[..., None].exp()
    else:  # one decay per key channel [n, BH, C, K]: each inside the sums over K
        c = g.cumsum(dim=-2)
        if float((c[..., 0, :] - c[..., -1, :]).detach().max()) <= SPAN_LIMIT:
            return _referred_chunk_terms(q, k, v, c, beta)
        A, scores = decayed_products(torch.stack([k * beta[..., None], q], dim=-3), k, c).unbind(-3)
        read_decay, to_end = c.exp(), (c[..., -1:, :] - c).exp()
    T = _unit_lower_inverse(A) * beta[..., None, :]
    k_to_end_t = (k * to_end).transpose(-1, -2)
    return q * read_decay, T @ (k * read_decay), T @ v, scores, k_to_end_t, read_decay[..., -1:, :].transpose(-1, -2)


def _referred_chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, beta: torch.Tensor):
    """`_chunk_terms` for a decay per key channel where none decays by more than SPAN_LIMIT within the
    chunk, all from one exp: s = exp(c - c_1) in [exp(-SPAN_LIMIT), 1]. The products are referred to
    the chunk's first row, exp(c_i - c_j) = s_i / s_j, so A and the scores are (k s) and (q s) times
    (k / s) (one product each; A's upper half, at most exp(SPAN_LIMIT), unread by the solve);
    exp(c) = s exp(c_1), whose channel factor exp(c_1) passes through T to scale W's columns, and
    exp(c_C - c_j) k_j = s_C (k / s)_j."""
    first = c[..., :1, :]
    s = (c - first).exp()
    ks, right_t = k * s, (k / s).transpose(-1, -2)
    q_s = q * s
    T = _unit_lower_inverse((ks @ right_t) * beta[..., None]) * beta[..., None, :]
    start, last = first.exp(), s[..., -1:, :]
    return (q_s * start, (T @ ks) * start, T @ v, (q_s @ right_t).tril(), right_t * last.transpose(-1, -2),
            (last * start).transpose(-1, -2))


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + tril(A, -1))^-1 [..., C, C]: one batched triangular solve against I (A's diagonal and upper
    half unread)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
