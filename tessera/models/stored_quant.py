"""Linear layers that keep a pre-quantized checkpoint's weights as the checkpoint stores them.

The layers of tessera/models/quantized.py are Tessera's own formats, quantized at load; these hold
the codes a compressed-tensors directory (the format llm-compressor writes) or a DeepSeek-V3
block-FP8 directory brings, under the checkpoint's own tensor names, so the loader
(tessera/checkpoint/prequantized/load.py) fills each buffer from the tensor of that name:

- `PackedIntLinear` (compressed-tensors `pack-quantized`): b-bit integers (b = 4 or 8) offset by
  2^(b-1) and packed densely into int32 words along the input dim (`weight_packed` [out,
  ceil(in * b / 32)]; element i of a row sits at bits b * (i % (32 / b)) of word i // (32 / b)),
  `weight_scale` [out, G] (G = 1 per channel, in / group_size per group; [1] per tensor), for an
  asymmetric scheme `weight_zero_point` packed the same way along the output dim
  ([ceil(out * b / 32), G]), and with activation ordering `weight_g_idx` [in] (the group of each
  input column). Weight W[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)].
- `IntQuantizedLinear` (`int-quantized`, W8A8): int8 `weight` [out, in], `weight_scale` [out, 1]
  or [1] (optional `weight_zero_point`); W = (q - z) * s.
- `FloatQuantizedLinear` (`float-quantized`): float8_e4m3fn `weight`, `weight_scale` [out, 1] or
  [1]; W = c * s.
- `BlockFp8Linear`: float8_e4m3fn `weight` with one scale per (bh x bw) block, [ceil(out / bh),
  ceil(in / bw)] (DeepSeek-V3 calls it `weight_scale_inv`, compressed-tensors' block strategy
  `weight_scale`); W[o, i] = c[o, i] * s[o // bh, i // bw].

Each computes by the plain PyTorch reference: the input activations quantized and dequantized as
the checkpoint's scheme says (`ActivationQuant`), then F.linear with the dequantized weight (in
the activations' dtype). The codes stay in their stored precision in memory: 0.5 byte per weight
for 4-bit, 1 byte for int8 and e4m3, plus the scales. A model served on CPU in fp32 multiplies the
integer formats (`PackedIntLinear`, `IntQuantizedLinear`) by their codes instead, read where they
lie by the GGUF kernel's arithmetic (the `fused` seam, after the activations' rounding;
tessera.infer.cpu.quant_matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.int8 import FusedProduct, fused_product

INT_RANGE = {8: (-128.0, 127.0)}  # activations: int8 only
FP8_RANGE = (-448.0, 448.0)  # float8_e4m3fn's finite range


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """Signed b-bit integers (float32) from int32 words packed along the last dim: [..., words] ->
    [..., count]. Element j of a word is bits [b * j, b * (j + 1)), stored with the offset 2^(b-1)."""
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * num_bits
    codes = (packed.unsqueeze(-1) >> shifts) & mask  # arithmetic shift, then the mask drops the sign bits
    return codes.flatten(-2)[..., :count].float() - (1 << (num_bits - 1))


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's input is quantized before the product (symmetric, as the scheme stores it):
    `kind` "int" (int8) or "float" (e4m3); `strategy` "token" (one scale per token, over the
    last dim), "tensor" (one for the whole input) or "group" (per `group_size` inputs of a token);
    `dynamic`: scales from the input itself, else the static `input_scale` buffer."""

    kind: str
    strategy: str
    dynamic: bool
    group_size: int | None = None

    def __call__(self, x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
        lo, hi = INT_RANGE[8] if self.kind == "int" else FP8_RANGE
        xf = x.float()
        if self.strategy == "group":
            xf = xf.unflatten(-1, (-1, self.group_size))
        if self.dynamic:
            if self.strategy == "tensor":
                absmax = torch.maximum(xf.amax().clamp(min=0), -xf.amin().clamp(max=0))
            else:
                absmax = torch.maximum(xf.amax(-1, keepdim=True).clamp(min=0), -xf.amin(-1, keepdim=True).clamp(max=0))
            scale = absmax / ((hi - lo) / 2)
            scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        else:
            scale = static_scale.float()
        q = torch.clamp(xf / scale, lo, hi)
        q = torch.round(q) if self.kind == "int" else q.to(torch.float8_e4m3fn).float()
        return (q * scale).reshape(x.shape).to(x.dtype)


class StoredQuantLinear(nn.Module):
    """A linear layer with a checkpoint's quantized weight; subclasses say how it dequantizes."""

    quantized = True  # not quantizable again (tessera/models/int8.py quantizable_layers)
    method = "pre-quantized"
    fused: FusedProduct | None = None  # the kernel seam (int8.fused_product), after the activations' rounding

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 act: ActivationQuant | None = None):
        super().__init__()
        self.in_features, self.out_features, self.act = in_features, out_features, act
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if act is not None and not act.dynamic:
            self.register_buffer("input_scale", torch.ones(1))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            x = self.act(x, getattr(self, "input_scale", None))
        y = fused_product(self, x)
        return y if y is not None else F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act={self.act}"


class PackedIntLinear(StoredQuantLinear):
    """compressed-tensors `pack-quantized`: 4- or 8-bit integer codes packed in int32 words."""

    method = "compressed-tensors pack-quantized"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, num_bits: int,
                 groups: int, group_size: int | None, symmetric: bool, g_idx: bool):
        super().__init__(in_features, out_features, bias, dtype)
        self.num_bits, self.group_size = num_bits, group_size
        words = -(-in_features * num_bits // 32)
        self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.ones(out_features if groups else 1, max(groups, 1), dtype=dtype))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features]))
        if not symmetric:
            zp_rows = -(-out_features * num_bits // 32)
            self.register_buffer("weight_zero_point", torch.zeros(zp_rows, max(groups, 1), dtype=torch.int32))
        if g_idx:
            self.register_buffer("weight_g_idx", torch.zeros(in_features, dtype=torch.int32))

    def column_groups(self) -> torch.Tensor:
        """The scale column of every input column."""
        if hasattr(self, "weight_g_idx"):
            return self.weight_g_idx.long()
        cols = torch.arange(self.in_features, device=self.weight_packed.device)
        return cols // self.group_size if self.group_size else torch.zeros_like(cols)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int32(self.weight_packed, self.num_bits, self.in_features)
        g = self.column_groups()
        if hasattr(self, "weight_zero_point"):
            zp = unpack_int32(self.weight_zero_point.t(), self.num_bits, self.out_features).t()
            q = q - zp[:, g]
        scale = self.weight_scale.float().expand(self.out_features, -1)
        return (q * scale[:, g]).to(dtype)


class IntQuantizedLinear(StoredQuantLinear):
    """compressed-tensors `int-quantized`: int8 weights, one scale per output channel or tensor."""

    method = "compressed-tensors int-quantized"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, per_channel: bool,
                 symmetric: bool, act: ActivationQuant | None):
        super().__init__(in_features, out_features, bias, dtype, act)
        rows = out_features if per_channel else 1
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(rows, 1, dtype=dtype))
        if not symmetric:
            self.register_buffer("weight_zero_point", torch.zeros(rows, 1, dtype=torch.int8))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        q = self.weight.float()
        if hasattr(self, "weight_zero_point"):
            q = q - self.weight_zero_point.float()
        return (q * self.weight_scale.float()).to(dtype)


class FloatQuantizedLinear(StoredQuantLinear):
    """compressed-tensors `float-quantized`: e4m3 weights, one scale per output channel or tensor."""

    method = "compressed-tensors float-quantized"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, per_channel: bool,
                 act: ActivationQuant | None):
        super().__init__(in_features, out_features, bias, dtype, act)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(out_features if per_channel else 1, 1, dtype=dtype))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale.float()).to(dtype)


class BlockFp8Linear(StoredQuantLinear):
    """e4m3 weights with one scale per (block[0] x block[1]) block, in buffer `scale_name`."""

    method = "block fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 block: tuple[int, int], scale_name: str, act: ActivationQuant | None = None):
        super().__init__(in_features, out_features, bias, dtype, act)
        # A block as large as the weight or larger is one block along that dim: the same scale grid
        # (ceil(dim / block) = 1) and the same values, but repeating a scale never asks for more
        # rows or columns than the weight has (a config's block of 2^40 is not 4 TB of scales).
        block = (min(int(block[0]), out_features), min(int(block[1]), in_features))
        self.block, self.scale_name = block, scale_name
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        self.register_buffer(scale_name, torch.ones(rows, cols, dtype=torch.float32))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        s = getattr(self, self.scale_name).float()
        s = s.repeat_interleave(self.block[0], 0)[:self.out_features].repeat_interleave(self.block[1], 1)
        return (self.weight.float() * s[:, :self.in_features]).to(dtype)


def stored_quant_method(model: nn.Module) -> str | None:
    """The format of a model's checkpoint-quantized layers ("compressed-tensors pack-quantized", ...),
    None when it has none."""
    methods = sorted({m.method for m in model.modules() if isinstance(m, StoredQuantLinear)})
    return ", ".join(methods) or None
