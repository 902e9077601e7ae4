"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv 2210.17323): one linear layer's weights quantized column by column,
each column's rounding error spread over the columns not yet quantized so that the layer's output
on the calibration inputs moves as little as possible.

For a layer y = W x with calibration inputs X [n, in], the objective is ||X W^T - X Q^T||^2, whose
Hessian in each row of W is H = 2 X^T X / n (the paper's H = 2 X X^T, with X [in, n]). With the
Cholesky factor U of H^-1 (upper, H^-1 = U^T U; the paper's eq. 5 row updates read off its rows):
quantizing column i to q_i leaves the error e_i = (w_i - q_i) / U_ii, and the later columns j > i
absorb it as w_j -= e_i U_ij. Columns go in lazy blocks of `block_size`: the update reaches the
columns inside the block at once and the rest of the matrix once per block (the paper's Sec. 4,
"lazy batch updates"). H is dampened first, H += `dampening` * mean(diag H) * I, so the inverse
exists and stays well conditioned; an input channel that never fires (H_ii = 0) gets H_ii = 1 and
zero weights, since nothing it multiplies reaches the output.

Scales: group-wise (or per channel), round-to-nearest over the weights as they are when their
group's first column is reached (already corrected by the columns before). With `actorder` the
columns are visited by decreasing H_ii (the inputs with the largest energy first, when most columns
are left to absorb their error) while the groups stay the consecutive input ranges of the stored
format, their scales taken from the original weights up front (llm-compressor's "weight" activation
ordering): the checkpoint is laid out exactly as without it, no `g_idx`.
"""

from __future__ import annotations

import torch

from tessera.quantize.formats import QuantizedWeight, Scheme, int_codes, int_scales

DEFAULT_DAMPENING = 0.01  # the paper's 1% of the mean diagonal
DEFAULT_BLOCK = 128


def inverse_hessian_factor(h: torch.Tensor, dampening: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + dampening * mean(diag H) * I)^-1, in float64."""
    h = h.double().clone()
    idx = torch.arange(h.shape[0])
    h[idx, idx] += dampening * h.diagonal().mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, dtype: torch.dtype,
                  dampening: float = DEFAULT_DAMPENING, block_size: int = DEFAULT_BLOCK) -> QuantizedWeight:
    """Quantize `w` [out, in] against Hessian `h` [in, in] (2 X^T X / n of its calibration inputs);
    scales in `dtype`."""
    out_f, in_f = w.shape
    w = w.double().clone()
    h = h.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    group = scheme.group_size or in_f
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if scheme.actorder else torch.arange(in_f)
    scale = int_scales(w, scheme, dtype) if scheme.actorder else None  # static groups (module docstring)
    if scale is None:
        scale = torch.ones(out_f, in_f // group, dtype=dtype)
    w, h = w[:, order], h[order][:, order]
    u = inverse_hessian_factor(h, dampening)
    codes = torch.zeros(out_f, in_f, dtype=torch.int8)
    for start in range(0, in_f, block_size):
        stop = min(start + block_size, in_f)
        block = w[:, start:stop].clone()  # [out, b]: its columns corrected in place
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            column = int(order[start + i])
            if not scheme.actorder and column % group == 0:  # the group's first column: its scale now
                ahead = torch.cat((block[:, i:], w[:, stop:]), dim=1)[:, :group]
                scale[:, column // group] = int_scales(ahead, Scheme("int", scheme.bits, None, False), dtype)[:, 0]
            s = scale[:, column // group].double()
            q = int_codes(block[:, i:i + 1], s[:, None], scheme)
            codes[:, column] = q[:, 0]
            err = (block[:, i] - q[:, 0].double() * s) / u[start + i, start + i]
            block[:, i:] -= err[:, None] * u[start + i, start + i:stop][None, :]
            errors[:, i] = err
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return QuantizedWeight(codes, scale)


def hessian_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): with H = 2 X^T X / n, twice the mean over the n inputs of the squared
    output error ||(W - Q) x||^2, the quantity GPTQ minimises."""
    e = (w.double() - q.double())
    return float(((e @ h.double()) * e).sum())
