"""Cross-entropy of the LM head without the whole micro-batch's logits in memory.

    loss_sum = sum_t CE(h_t W^T, y_t)        h [T, D] final hidden states, W [V, D] head weight

The plain loss materialises logits [T, V] and their fp32 copy, and autograd keeps both for
backward: at T = 8192 tokens and V = 128k that is 4 GiB for the fp32 copy alone, more than a
transformer block's activations. Here the T tokens are taken `chunk` at a time: each chunk's
logits are computed, reduced to their loss and freed. Backward recomputes each chunk's logits
and uses the closed form of the cross-entropy gradient, d CE / d logits = softmax(logits) -
onehot(y) (zero on ignored positions), so neither pass ever holds more than [chunk, V] logits
(the recompute trades one extra head GEMM for the memory, as Liger-Kernel's fused linear
cross-entropy and torchtune's chunked loss do).

Arithmetic follows the plain loss: logits in the compute dtype (bf16 under autocast), upcast to
fp32 for log-softmax; the head's gradients are accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # targets with this id count no loss (torch's cross_entropy default)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(h_t W^T, y_t) over `chunk`-token slices; backward recomputes each slice."""

    @staticmethod
    def forward(ctx, h_TD: torch.Tensor, w_VD: torch.Tensor, y_T: torch.Tensor, chunk: int,
                ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for s in range(0, h_TD.shape[0], chunk):
            logits_CV = (h_TD[s:s + chunk] @ w_VD.T).float()
            total = total + F.cross_entropy(logits_CV, y_T[s:s + chunk], ignore_index=ignore_index,
                                            reduction="sum")
        ctx.save_for_backward(h_TD, w_VD, y_T)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h_TD, w_VD, y_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h_TD) if need_h else None
        grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        for s in range(0, h_TD.shape[0], ctx.chunk):
            h_CD, y_C = h_TD[s:s + ctx.chunk], y_T[s:s + ctx.chunk]
            g_CV = torch.softmax((h_CD @ w_VD.T).float(), dim=-1)  # d CE / d logits = p - onehot(y)
            valid_C = y_C != ctx.ignore_index
            g_CV.scatter_add_(1, y_C.clamp(min=0)[:, None], torch.full_like(g_CV[:, :1], -1.0))
            g_CV = (g_CV * (valid_C[:, None] * grad_out)).to(h_TD.dtype)
            if need_h:
                grad_h[s:s + ctx.chunk] = g_CV @ w_VD
            if need_w:
                grad_w += (g_CV.T @ h_CD).float()
        return grad_h, grad_w.to(w_VD.dtype) if need_w else None, None, None, None


def chunked_linear_cross_entropy(h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, chunk: int,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """fp32 sum over tokens of CE(h W^T, targets), never holding more than [chunk, V] logits.

    h [T, D], w [V, D] (the LM head as nn.Linear stores it), targets [T]; under autocast h and w
    are cast to the autocast dtype first, as the plain head's nn.Linear would be."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    device = h_TD.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        h_TD, w_VD = h_TD.to(dtype), w_VD.to(dtype)
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h_TD, w_VD, targets_T, chunk, ignore_index)
