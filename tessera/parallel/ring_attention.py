"""Ring attention: exact causal attention of the whole sequence with each cp rank holding only its
own tokens' keys and values plus one block in flight (Liu et al. 2023, "Ring Attention with
Blockwise Transformers", arXiv 2310.01889; the merge is FlashAttention's online softmax, Dao 2023,
arXiv 2307.08691, algorithm 1-2).

Forward, on cp rank r, for step i = 0 .. cp-1: it holds the key/value block of rank (r - i) mod cp.
Before computing on it, it issues the send of that block to rank r+1 and the receive of the next
one from rank r-1 (`isend` / `irecv`), so the transfer runs while it computes; then the partial
attention of its queries over the block, masked by the global positions of both (causal, sliding
window; the zig-zag split of sequence_layout.py makes every rank's work equal), is merged into
the running output by its log-sum-exp:

    lse = log(exp(lse) + exp(lse_b)),  out = out exp(lse_old - lse) + out_b exp(lse_b - lse)

Backward (explicit, from the saved output and log-sum-exp; FlashAttention-2's): with
delta = sum(dout * out), per block p = exp(s - lse), dv = p^T dout, ds = p (dout v^T - delta),
dq += ds k scale, dk = ds^T q scale. The key/value blocks travel the ring again (overlapped with
compute the same way), and each block's dk/dv accumulator travels with it, one hop behind, back
to the rank that owns it after cp hops. Blocks travel in the input dtype; scores, the merge and
the gradient accumulators are fp32.

Each block pair computes only the query rows and key columns its mask leaves any pair visible in
(an empty pair is skipped); with the zig-zag split every rank then computes the same number of
(query, key) pairs. Shapes: B batch, H query heads, G kv heads,
C tokens per rank, D / Dv head dims; GQA repeats a block's kv heads locally (the ring carries G).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tessera.models.attention import Window, sliding_window_mask
from tessera.parallel.sequence_layout import all_rank_positions

KV_TAG, GRAD_TAG = 0, 1
# (event "send" | "compute", phase "forward" | "backward", step, (query, key) pairs computed; 0 for a send)
Trace = Callable[[str, str, int, int], None]


def _no_trace(event: str, phase: str, step: int, pairs: int) -> None:
    return None


class _Ring:
    """This rank's neighbours on the cp ring and the asynchronous send-next / receive-previous pair."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def pass_on(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `x` to the next rank and receiving its counterpart from the previous one."""
        incoming = torch.empty_like(x)
        # One batch, so that NCCL posts both at once (two ranks that each sent first would deadlock).
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group, tag),
                                           dist.P2POp(dist.irecv, incoming, self.prev, self.group, tag)])
        return incoming, requests


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Window):
    """The block pair's work: the query rows and key columns with any visible (query, key) pair, and
    the mask between them. Under the zig-zag split an off-diagonal pair keeps half its rows (the
    later source) or half its columns (the earlier one), so every rank computes the same area."""
    mask = sliding_window_mask(q_pos, k_pos, window)
    rows, cols = mask.any(dim=1).nonzero().squeeze(1), mask.any(dim=0).nonzero().squeeze(1)
    return rows, cols, mask.index_select(0, rows).index_select(1, cols)


def _scores(q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, scale: float, mask_CC: torch.Tensor) -> torch.Tensor:
    k = k_BGCD.repeat_interleave(q_BHCD.shape[1] // k_BGCD.shape[1], dim=1)
    s = (q_BHCD @ k.transpose(-1, -2)) * scale
    return s.masked_fill(~mask_CC, float("-inf"))


def _sum_groups(x_BHCD: torch.Tensor, G: int) -> torch.Tensor:
    """[B, H, C, D] -> [B, G, C, D]: the backward of repeating each kv head H/G times."""
    B, H, C, D = x_BHCD.shape
    return x_BHCD.view(B, G, H // G, C, D).sum(dim=2)


def _begin_step(ring: _Ring, kv: torch.Tensor, step: int, q_pos: torch.Tensor, positions_PC: torch.Tensor,
                window: Window, trace, phase: str):
    """Start a ring step: post the transfer of the block held now to the next rank (before any compute
    on it, so the transfer overlaps that compute), then say which (rows, cols) of the block held now,
    from rank r - step, this rank's queries see. Returns (incoming, requests, rows, cols, mask)."""
    incoming, requests = None, []
    if step < ring.cp - 1:
        incoming, requests = ring.pass_on(kv, KV_TAG)
        trace("send", phase, step, 0)
    src = (ring.rank - step) % ring.cp
    rows, cols, mask = _visible(q_pos, positions_PC[src], window)
    return incoming, requests, rows, cols, mask


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, window, group, positions_PC, trace):
        ring = _Ring(group)
        q32, D, Dv = q.float(), k.shape[-1], v.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()  # one message per block, in the input dtype
        B, H, C, _ = q.shape
        out = q32.new_zeros(B, H, C, Dv)
        lse = q32.new_full((B, H, C), float("-inf"))
        q_pos = positions_PC[ring.rank]
        for step in range(ring.cp):
            incoming, requests, rows, cols, mask = _begin_step(ring, kv, step, q_pos, positions_PC, window,
                                                               trace, "forward")
            if rows.numel():
                trace("compute", "forward", step, rows.numel() * cols.numel())
                k_b, v_b = kv.index_select(2, cols).float().split([D, Dv], dim=-1)
                s = _scores(q32.index_select(2, rows), k_b, scale, mask)
                lse_b = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - lse_b.unsqueeze(-1)).nan_to_num(0.0)  # rows with no visible key: 0
                out_b = p @ v_b.repeat_interleave(H // k.shape[1], dim=1)
                lse_r, out_r = lse.index_select(2, rows), out.index_select(2, rows)
                new = torch.logaddexp(lse_r, lse_b)
                safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
                out_r = out_r * torch.exp(lse_r - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
                out.index_copy_(2, rows, out_r)
                lse.index_copy_(2, rows, new)
            for request in requests:
                request.wait()
            if requests:
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, positions_PC)
        ctx.scale, ctx.window, ctx.group, ctx.trace = scale, window, group, trace
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions_PC = ctx.saved_tensors
        ring, scale, trace = _Ring(ctx.group), ctx.scale, ctx.trace
        G, D, Dv = k.shape[1], k.shape[-1], v.shape[-1]
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out).sum(dim=-1, keepdim=True)  # [B, H, C, 1]
        dq = torch.zeros_like(q32)
        kv = torch.cat([k, v], dim=-1).contiguous()
        grad_in, grad_requests = None, []  # the accumulator of this step's block, arriving from rank r-1
        q_pos = positions_PC[ring.rank]
        for step in range(ring.cp):
            incoming, kv_requests, rows, cols, mask = _begin_step(ring, kv, step, q_pos, positions_PC, ctx.window,
                                                                  trace, "backward")
            grad_b = torch.zeros_like(kv, dtype=torch.float32)
            if rows.numel():
                trace("compute", "backward", step, rows.numel() * cols.numel())
                k_b, v_b = kv.index_select(2, cols).float().split([D, Dv], dim=-1)
                rep = q.shape[1] // G
                q_r, dout_r = q32.index_select(2, rows), dout32.index_select(2, rows)
                p = torch.exp(_scores(q_r, k_b, scale, mask) - lse.index_select(2, rows).unsqueeze(-1))  # masked: 0
                dv_b = p.transpose(-1, -2) @ dout_r
                ds = p * (dout_r @ v_b.repeat_interleave(rep, dim=1).transpose(-1, -2) - delta.index_select(2, rows))
                dq.index_add_(2, rows, (ds @ k_b.repeat_interleave(rep, dim=1)) * scale)
                dk_b = (ds.transpose(-1, -2) @ q_r) * scale
                grad_b.index_copy_(2, cols, torch.cat([_sum_groups(dk_b, G), _sum_groups(dv_b, G)], dim=-1))
            for request in grad_requests:
                request.wait()
            if grad_in is not None:
                grad_b = grad_in + grad_b
            grad_in, grad_requests = ring.pass_on(grad_b.contiguous(), GRAD_TAG)
            for request in kv_requests:
                request.wait()
            if kv_requests:
                kv = incoming
        for request in grad_requests:
            request.wait()
        dk, dv = grad_in.split([D, Dv], dim=-1)  # after cp hops: the gradient of this rank's own block
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


class RingAttention:
    """The ring core: (q [B, H, C, D], k [B, G, C, D], v [B, G, C, Dv], scale, window) -> [B, H, C, Dv],
    exact causal attention of the whole sequence with the tokens split over `group` by `layout`.
    `trace`, when set, is called with ("send" | "compute", "forward" | "backward", step, pairs) as
    each block transfer is issued and each block is computed (tests read the order from it)."""

    def __init__(self, group: ProcessGroup, layout: str = "zigzag"):
        self.group, self.layout = group, layout
        self.trace: Trace = _no_trace

    def __call__(self, q_BHCD: torch.Tensor, k_BGCD: torch.Tensor, v_BGCD: torch.Tensor, scale: float,
                 window: Window = None) -> torch.Tensor:
        positions = all_rank_positions(q_BHCD.shape[2], dist.get_world_size(self.group), self.layout,
                                       q_BHCD.device)
        with torch.autocast(q_BHCD.device.type, enabled=False):
            return _RingAttentionFunction.apply(q_BHCD, k_BGCD, v_BGCD, scale, window, self.group, positions,
                                                self.trace)
