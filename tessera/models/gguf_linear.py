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

`GgufEmbedding` keeps a token embedding stored in a block type the same way: a lookup dequantizes
only the rows of the tokens asked for (the values the whole matrix dequantized at load would hold,
bit for bit; a served model on CPU dequantizes them in one C++ call at `fused`, the same values), so
the [vocab, dim] float matrix never exists; `weight` dequantizes all of it, for a
reader of the whole matrix. A tied LM head over it is a `GgufLinear` over the same buffer (one copy
in memory: tessera/checkpoint/gguf/load.py), since the model's `tied_head` seam multiplies by a float
matrix.
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


class GgufEmbedding(nn.Module):
    """Token embeddings [..., dim] in `dtype` looked up in a [num_embeddings, dim] matrix held as GGML
    `kind` blocks (a buffer [num_embeddings, row bytes])."""

    quantized = True
    # (embedding, ids) -> the rows, or None to take the reference; set by tessera.infer.cpu.gguf_matmul
    fused: Callable[[nn.Module, torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, kind: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        if kind not in BLOCKS:
            raise ValueError(f"GGML type {kind!r} has no torch dequantizer; supported: {', '.join(BLOCKS)}")
        self.kind, self.num_embeddings, self.embedding_dim, self.dtype = kind, num_embeddings, embedding_dim, dtype
        self.register_buffer("blocks", torch.zeros(num_embeddings, row_bytes(kind, embedding_dim),
                                                   dtype=torch.uint8, device=device))

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix dequantized [num_embeddings, dim] (a new tensor each time)."""
        return dequantize(self.kind, self.blocks, (self.num_embeddings, self.embedding_dim)).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused(self, ids)
            if y is not None:
                return y
        rows = self.blocks[ids.reshape(-1)]
        values = dequantize(self.kind, rows, (rows.shape[0], self.embedding_dim)).to(self.dtype)
        return values.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.num_embeddings}, {self.embedding_dim}"
