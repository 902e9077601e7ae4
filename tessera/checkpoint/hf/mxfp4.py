"""MXFP4 expert weights (gpt-oss's published checkpoints, `quantization_config.quant_method: mxfp4`),
dequantized as they are read.

The OCP microscaling format: a weight W [E, O, I] of the model (HuggingFace's `gate_up_proj`
[E, D, 2F] and `down_proj` [E, F, D] are stored transposed, as [E, 2F, D] and [E, D, F]) is cut
along its last dimension into blocks of 32 values. Each block is stored as 16 bytes of FP4 (E2M1)
codes, two per byte, the low nibble first (`{name}_blocks`, uint8 [E, O, I/32, 16]), and one shared
power of two, an 8-bit exponent biased by 127 (`{name}_scales`, uint8 [E, O, I/32]):

    value = FP4[code] * 2^(scale - 127),   FP4 = 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (bit 3)

`Mxfp4Tensors` finds such pairs among a directory's tensors whose plain name is absent and stands
in for the plain tensor: its shape as the model holds it, and any box of it, read from the
experts that box covers (the ones a rank owns under expert parallelism) and dequantized.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., O, G, 16] codes and [..., O, G] exponents -> the weight [..., G * 32, O] (transposed
    back to the model's layout) in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair (uint8 [..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.flatten(-2).transpose(-1, -2).to(dtype)


def mxfp4_pairs(keys: set[str]) -> dict[str, tuple[str, str]]:
    """Plain name -> (blocks key, scales key) for every pair whose plain name is not stored itself."""
    return {k.removesuffix(BLOCKS): (k, k.removesuffix(BLOCKS) + SCALES) for k in keys
            if k.endswith(BLOCKS) and k.removesuffix(BLOCKS) + SCALES in keys and k.removesuffix(BLOCKS) not in keys}


class Mxfp4Tensors:
    """The dequantized stand-ins for a directory's MXFP4 pairs (module docstring). `raw(key, offsets,
    sizes)` reads a box of a stored uint8 tensor (the caller's reader)."""

    def __init__(self, keys: set[str], raw):
        self.pairs, self.raw = mxfp4_pairs(keys), raw
        self.shapes: dict[str, tuple[int, ...]] = {}

    def stored_shape(self, key: str, shape_of) -> tuple[int, ...]:
        """The plain tensor's shape [E, I, O] from its blocks' [E, O, G, 16]."""
        if key not in self.shapes:
            E, O, G, _ = shape_of(self.pairs[key][0])
            self.shapes[key] = (E, G * BLOCK, O)
        return self.shapes[key]

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], shape_of) -> torch.Tensor:
        """The box of plain tensor `key` (its experts' codes and scales read, dequantized, cut)."""
        E, _, O = self.stored_shape(key, shape_of)
        e0, n = offsets[0], sizes[0]
        blocks_key, scales_key = self.pairs[key]
        G = self.shapes[key][1] // BLOCK
        blocks = self.raw(blocks_key, (e0, 0, 0, 0), (n, O, G, 16))
        scales = self.raw(scales_key, (e0, 0, 0), (n, O, G))
        whole = dequantize_mxfp4(blocks, scales)
        return whole[:, offsets[1]:offsets[1] + sizes[1], offsets[2]:offsets[2] + sizes[2]]
