"""A linear layer whose weight stays in a GGUF file's block format in memory (`GgufLinear`).

The weight is kept as the file stores it: the raw bytes of its blocks (a uint8 buffer [out,
row bytes], in the model's row order) with its GGML type and logical shape [out, in], so a Q4_1
matrix takes 20 bytes per 32 weights instead of 128 (float32). The layer's own forward is the plain
PyTorch reference: it dequantizes the whole weight on the buffer's device
(`tessera.models.gguf_blocks`, float32, the values gguf's own dequantizer gives) and multiplies in
the activations' dtype with F.linear; the float copy lives only for that product. A served model
on CPU in fp32 multiplies by the blocks instead: the engine installs a kernel at `fused`
(tessera.infer.cpu.gguf_matmul: the activations rounded to int16 per 32 inputs, integer products
with the unpacked blocks, the scales applied per 32), which takes the decode steps and short prompt
chunks without autograd and leaves the rest to the reference (docs/benchmarks.md measures both).
A bias, when the layer has one, is a float parameter as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.gguf_blocks import BLOCKS, dequantize, row_bytes


class GgufLinear(nn.Module):
    """y = x W^T (+ b) with W held as GGML `kind` blocks ([out_features, in_features] logically)."""

    quantized = True  # not quantizable again (tessera.models.int8.quantizable_layers)
    # (layer, x) -> y, or None to take the reference; set per layer by tessera.infer.cpu.gguf_matmul
    fused: Callable[[nn.Module, torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, kind: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        if kind not in BLOCKS:
            raise ValueError(f"GGML type {kind!r} has no torch dequantizer; supported: {', '.join(BLOCKS)}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.register_buffer("blocks", torch.zeros(out_features, row_bytes(kind, in_features), dtype=torch.uint8,
                                                   device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.kind, self.blocks, (self.out_features, self.in_features)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused(self, x)
            if y is not None:
                return y
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"
