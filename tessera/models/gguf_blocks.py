"""GGML's block-quantized weight formats, dequantized in PyTorch (on the blocks' own device).

A GGUF file stores a [rows, cols] matrix of a quantized type row by row, each row a run of
fixed-size blocks (ggml-common.h's `block_*` structs), all little-endian:

- Q8_0 (32 values, 34 bytes): fp16 d, 32 int8 q; x = q * d.
- Q4_0 (32, 18): fp16 d, 16 bytes of nibbles; value j < 16 is byte j's low nibble, value 16 + j
  its high one; x = d * (q - 8).
- Q4_1 (32, 20): fp16 d, fp16 m, nibbles as Q4_0; x = d * q + m.
- Q5_0 (32, 22): fp16 d, 32 high bits (bit j of the little-endian word is value j's fifth bit),
  nibbles as Q4_0; x = d * (q - 16).
- Q5_1 (32, 24): fp16 d, fp16 m, high bits, nibbles; x = d * q + m.
- Q2_K (256, 84): 16 bytes of 4-bit scale / 4-bit min per 16 values, 64 bytes of 2-bit q (byte i
  of each 32-byte half holds values i, 32 + i, 64 + i, 96 + i of that half in bits 0-1, 2-3, 4-5,
  6-7), fp16 d, fp16 dmin; x = d * scale * q - dmin * min.
- Q3_K (256, 110): 32 bytes of high-bit masks (bit k of byte i: value 32k + i), 64 bytes of low
  2-bit q (as Q2_K), 12 bytes of 6-bit scales (8 bytes of low nibbles, 4 bytes of high 2-bit pairs),
  fp16 d; q = low - 4 when the mask bit is clear; x = d * (scale - 32) * q.
- Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, 128
  bytes of nibbles (each 32-byte group: 32 values in the low nibbles, the next 32 in the high);
  x = d * scale * q - dmin * min per 32 values.
- Q5_K (256, 176): as Q4_K with 32 bytes of fifth bits (bit k of byte i: value 32k + i).
- Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, fp16 d;
  x = d * scale * (q - 32) per 16 values.
- MXFP4 (32, 17; gpt-oss's experts): one E8M0 byte e, then nibbles as Q4_0, each an E2M1 code; x =
  2^(e - 128) * v[q], v the E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives).

`dequantize(kind, blocks, shape)` gives float32 values with the same operations in the same
order as gguf's own `gguf.quants.dequantize`, so the two agree bit for bit (test_gguf_blocks.py).
"""

from __future__ import annotations

import torch

QK = 32  # values per block of the simple types
QK_K = 256  # values per super-block of the K types

# GGML type -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (QK, 34), "Q4_0": (QK, 18), "Q4_1": (QK, 20), "Q5_0": (QK, 22), "Q5_1": (QK, 24),
          "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
          "MXFP4": (QK, 17)}
_E2M1_DOUBLED = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of `cols` values of block type `kind` (cols a multiple of its block)."""
    size, nbytes = BLOCKS[kind]
    if cols % size:
        raise ValueError(f"{kind} rows hold whole blocks of {size} values; {cols} is not a multiple")
    return cols // size * nbytes


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block [n, bytes], as float32 [n, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """Each byte of [n, k] split into 8 / width fields of `width` bits, lowest first: [n, 8 / width, k]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b[:, None, :] >> shifts[None, :, None]) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0-style nibbles [n, 16] -> values [n, 32]: the low nibbles, then the high ones."""
    return _bits(qs, 4).reshape(qs.shape[0], -1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """A little-endian 32-bit word [n, 4] -> its bits [n, 32], bit j at j."""
    return _bits(qh, 1).transpose(1, 2).reshape(qh.shape[0], -1)


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q2_k(b):
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n * 2, 32), 2).reshape(n, 16, 16).float()  # per half: 4 fields x 32 bytes
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    low = _bits(b[:, 96:104], 4).reshape(n, 16)  # scales 0-7 low nibbles, then 8-15
    high = _bits(b[:, 104:108], 2).reshape(n, 16)  # bits 0-1 of the four bytes, then 2-3, ...
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    ql = _bits(b[:, 32:96].reshape(n * 2, 32), 2).reshape(n, 16, 16)
    hm = _bits(b[:, :32], 1).reshape(n, 16, 16)  # bit k of byte i: value 32k + i
    q = (ql.to(torch.int8) - ((hm ^ 1) << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [n, 12] -> eight 6-bit scales and eight 6-bit mins, each [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    low = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scale, low


def _k4_scales(b):
    n = b.shape[0]
    scale, low = _scale_min_k4(b[:, 4:16])
    return (_f16(b, 0) * scale.float()).reshape(n, 8, 1), (_f16(b, 2) * low.float()).reshape(n, 8, 1)


def _q4_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b)
    q = _bits(b[:, 16:].reshape(n * 4, 32), 4).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b)
    ql = _bits(b[:, 48:].reshape(n * 4, 32), 4).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 1).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    ql = _bits(b[:, :128].reshape(n * 2, 64), 4).reshape(n, 8, 32)  # per half: 64 low, 64 high nibbles
    qh = _bits(b[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _mxfp4(b):
    e = b[:, :1].to(torch.int32)  # 2^(e - 128) built as ggml builds it (subnormal below e = 2)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    values = torch.tensor(_E2M1_DOUBLED, device=b.device)[_nibbles(b[:, 1:]).long()]
    return values * bits.view(torch.float32)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
               "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}


def dequantize(kind: str, blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """float32 [rows, cols] from the uint8 blocks of a `kind` matrix of that shape (any layout of
    its bytes in row order, e.g. [rows, row_bytes]), on the blocks' device."""
    size, nbytes = BLOCKS[kind]
    rows, cols = shape
    if blocks.dtype != torch.uint8 or blocks.numel() != rows * row_bytes(kind, cols):
        raise ValueError(f"{kind} [{rows}, {cols}] needs {rows * row_bytes(kind, cols)} uint8 bytes; got "
                         f"{blocks.numel()} {blocks.dtype}")
    return _DEQUANTIZE[kind](blocks.reshape(-1, nbytes)).reshape(rows, cols)
