"""FP8 linear layers with tensor-wise dynamic scaling (`train.fp8`), as in "FP8 Formats for Deep
Learning" (Micikevicius et al., 2022) and torchao's tensor-wise recipe.

Each matrix product of a converted layer runs on FP8 tensor cores (`torch._scaled_mm`): an operand
is scaled by `max(fp8) / amax(operand)` so that its largest magnitude lands on the format's largest
value, cast to FP8, and the product is computed with the inverse scales applied in the epilogue,
accumulating in fp32 and writing bf16 (the compute dtype) or fp32. Forward: input and weight in
E4M3 (3 mantissa bits, range 448). Backward: the output gradient in E5M2 (2 mantissa bits, range
57344: gradients need range more than precision), against the E4M3 input and weight:

    y = x W^T                 x, W in E4M3
    dx = dy W                 dy in E5M2
    dW = dy^T x

The scales come from amax reductions on the device (no host synchronisation) and are recomputed
for every product ("dynamic" scaling, no amax history). The input is saved for backward in FP8
(half the bytes of bf16); the weight is saved as given and cast again in backward. Master
weights, optimizer state and gradient accumulation stay as they are (fp32); only the matrix
products are FP8. The forward product accumulates with cuBLAS's fast FP8 accumulation, the two
gradient products exactly (torchao's default recipe).

`_scaled_mm` wants the inner dimension and the second operand's outer dimension to be multiples
of 16, so only layers with in and out features divisible by 16 are converted; the weight
gradient's inner dimension is the number of tokens, padded with zero rows where needed. Converted:
the `nn.Linear` layers of the transformer blocks (attention and dense/shared-expert MLPs). Not
converted: the LM head and embedding (precision-sensitive, as in torchtitan), the router (fp32 by
design), and the routed experts' grouped GEMMs (FP8 grouped GEMMs are not built).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16  # `_scaled_mm`: inner dimension and the second operand's outer dimension
_AMAX_FLOOR = 1e-12  # an all-zero operand gets a finite scale


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` scaled by max(dtype) / amax(t) and cast to `dtype`; returns (fp8 tensor, inverse scale),
    the scale an fp32 scalar on `t`'s device."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=_AMAX_FLOOR)
    scale = fmax / amax
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows appended up to a multiple of ALIGN (they add nothing to a product over rows)."""
    extra = -t.shape[0] % ALIGN
    return t if extra == 0 else F.pad(t.view(torch.uint8), (0, 0, 0, extra)).view(t.dtype)


def _mm(a_MK: torch.Tensor, inv_a: torch.Tensor, b_KN: torch.Tensor, inv_b: torch.Tensor,
        out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) in `out_dtype`; `a` row-major, `b` column-major."""
    return torch._scaled_mm(a_MK, b_KN, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class _Float8Matmul(torch.autograd.Function):
    """x [M, K] @ W[N, K]^T with FP8 operands, forward and backward (module docstring).

    Saved for backward: the input in FP8 (half of bf16's bytes) and the weight as given, not its
    FP8 copy: under FSDP the given weight is the all-gathered parameter, whose storage FSDP frees
    after forward and gathers again for backward, where an FP8 copy would keep every block's whole
    weight alive in between. Backward casts it again (as torchao does)."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x8, inv_x = to_float8(x_MK.contiguous(), E4M3)  # row-major: cuBLASLt takes no other first operand
        w8, inv_w = to_float8(w_NK, E4M3)
        ctx.save_for_backward(x8, inv_x, w_NK)
        ctx.x_dtype = x_MK.dtype
        # fast accumulation in the forward product only, as torchao's default recipe: the gradients'
        # products accumulate exactly
        return _mm(x8, inv_x, w8.t(), inv_w, out_dtype, fast_accum=True)  # W^T is column-major as stored

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x8, inv_x, w_NK = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g8, inv_g = to_float8(dy_MN.contiguous(), E5M2)
        dx = dw = None
        if need_x:
            w8, inv_w = to_float8(w_NK, E4M3)
            dx = _mm(g8, inv_g, w8.t().contiguous().t(), inv_w, ctx.x_dtype)  # [M, N] @ [N, K]
        if need_w:  # [N, M] @ [M, K]: M (tokens) is the inner dimension here
            g8_NM = _pad_rows(g8).t().contiguous()
            x8_MK = _pad_rows(x8).t().contiguous().t()
            dw = _mm(g8_NM, inv_g, x8_MK, inv_x, w_NK.dtype)
        return dx, dw, None


def float8_matmul(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in `out_dtype`, through FP8 (module docstring)."""
    y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose product runs in FP8. The same parameters and state-dict names, so
    checkpoints, HF conversion and the parallel plans see an ordinary linear layer. Under autocast
    the output has the autocast dtype, as a linear layer's would; otherwise the input's."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            y = float8_matmul(x, self.weight, out_dtype)
            return y if self.bias is None else y + self.bias.to(out_dtype)


def convertible(linear: nn.Linear) -> bool:
    """Whether `_scaled_mm` takes this layer's shapes."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def convert_to_float8(model: nn.Module) -> list[str]:
    """Replace the `nn.Linear` layers of `model`'s transformer blocks (`model.layers`) whose shapes
    `_scaled_mm` takes with `Float8Linear`, in place, keeping their parameters; returns the names
    of the converted layers. The LM head, embedding, router and grouped experts stay as they are."""
    converted = []
    for key, block in model.layers.items():
        for name, module in list(block.named_modules()):
            if type(module) is not nn.Linear or not convertible(module):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, leaf, Float8Linear.from_linear(module))
            converted.append(f"layers.{key}.{name}")
    return converted
