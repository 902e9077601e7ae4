"""The weight formats `tessera quantize` writes, as compressed-tensors (llm-compressor's format,
the one vLLM and transformers read) defines them, and the `quantization_config` that names them.

A quantized weight W [out, in] is integer or e4m3 codes Q and scales s in the model's stored dtype:

- int, symmetric, b bits (4 or 8): codes in [-2^(b-1), 2^(b-1) - 1]; one scale per output channel
  (`strategy: channel`) or per (output channel, group of `group_size` consecutive inputs)
  (`strategy: group`). Round-to-nearest scale s = max|W| / ((q_max - q_min) / 2), as
  llm-compressor's min-max observer computes it: the largest positive weight lands on q_max + 1/2
  and is clamped to q_max, the most negative on q_min;
- float8 e4m3: one scale per output channel, s = max|W| / 448, codes = W / s cast to e4m3
  (round to nearest, ties to even).

Dequantizing is Q cast to the scale's dtype times s (compressed-tensors' `dequantize`), so a reader
gets exactly `QuantizedWeight.dequantize()`. The scale is rounded to the stored dtype before the
codes are computed, so the codes are the ones that scale gives.

Stored tensors per quantized linear layer (HuggingFace prefix P):
- `pack-quantized` (int weights, no activation quantization: W4A16, W8A16): P.weight_packed int32
  [out, ceil(in * b / 32)] (code + 2^(b-1) as an unsigned b-bit field, element j of a row at bit
  (j * b) mod 32 of word j * b // 32, little-endian), P.weight_scale [out, groups], P.weight_shape
  int64 [2];
- `int-quantized` (int8 weights, dynamic per-token int8 activations: W8A8): P.weight int8,
  P.weight_scale [out, 1];
- `float-quantized` (FP8_DYNAMIC: e4m3 weights, dynamic per-token e4m3 activations): P.weight
  float8_e4m3fn, P.weight_scale [out, 1].
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

# The compressed-tensors release whose format this writer follows, and the tests check against.
FORMAT_VERSION = "0.20.0"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class Scheme:
    """How every quantized linear layer of a model is stored."""

    kind: str  # "int" or "float" (e4m3)
    bits: int  # 4 or 8 (float: 8)
    group_size: int | None  # inputs per scale; None: one scale per output channel
    dynamic_activations: bool  # inputs quantized per token at run time (same kind, 8 bits)
    actorder: bool = False  # GPTQ's columns were visited by decreasing Hessian diagonal (no g_idx)

    @property
    def format(self) -> str:
        if self.kind == "float":
            return "float-quantized"
        return "int-quantized" if self.dynamic_activations else "pack-quantized"

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def code_range(self) -> tuple[int, int]:
        return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1


@dataclass
class QuantizedWeight:
    """Codes [out, in] (int8 holding b-bit values, or float8_e4m3fn) and scales [out, groups]."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """codes * scale in the scale's dtype, as compressed-tensors' decompression computes it."""
        out_f, in_f = self.codes.shape
        groups = self.scale.shape[1]
        q = self.codes.to(self.scale.dtype).reshape(out_f, groups, in_f // groups)
        return (q * self.scale[..., None]).reshape(out_f, in_f)


def stored_scale(absmax: torch.Tensor, divisor: float, dtype: torch.dtype) -> torch.Tensor:
    """absmax / divisor in `dtype`; a scale of 0 (an all-zero group, or one that underflows) is 1,
    whose codes are then 0 and dequantize to 0 exactly."""
    s = (absmax.float() / divisor).to(dtype)
    return torch.where(s == 0, torch.ones_like(s), s)


def int_scales(w: torch.Tensor, scheme: Scheme, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest scales of `w` [out, in]: [out, groups] in `dtype`."""
    q_min, q_max = scheme.code_range()
    groups = scheme.groups(w.shape[1])
    absmax = w.float().reshape(w.shape[0], groups, -1).abs().amax(-1)
    return stored_scale(absmax, (q_max - q_min) / 2, dtype)


def int_codes(w: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """round(w / s) clamped to the code range: w [out, n], scale [out, n] (one per column) -> int8."""
    q_min, q_max = scheme.code_range()
    return torch.round(w.float() / scale.float()).clamp(q_min, q_max).to(torch.int8)


def quantize_int(w: torch.Tensor, scheme: Scheme, dtype: torch.dtype) -> QuantizedWeight:
    """Round-to-nearest int quantization of `w` [out, in] with scales in `dtype`."""
    scale = int_scales(w, scheme, dtype)
    per_column = scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
    return QuantizedWeight(int_codes(w, per_column, scheme), scale)


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """e4m3 codes with one scale per output channel (in `dtype`)."""
    scale = stored_scale(w.float().abs().amax(-1, keepdim=True), FP8_MAX, dtype)
    codes = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes, scale)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [out, in] of `bits` (4 or 8) -> int32 [out, ceil(in * bits / 32)], the layout of
    the module docstring."""
    out_f, in_f = codes.shape
    fields = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)  # unsigned b-bit values
    padded = math.ceil(in_f / 32) * 32
    fields = torch.nn.functional.pad(fields, (0, padded - in_f))
    data = fields if bits == 8 else fields[:, 0::2] | (fields[:, 1::2] << 4)  # [out, padded * bits / 8] bytes
    if sys.byteorder == "big":  # a word's least significant byte first, whatever the host
        data = data.reshape(out_f, -1, 4).flip(-1).reshape(out_f, -1)
    return data.contiguous().view(torch.int32)[:, :math.ceil(in_f * bits / 32)].contiguous()


def stored_tensors(prefix: str, q: QuantizedWeight, scheme: Scheme) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear layer under HuggingFace prefix `prefix` (module docstring)."""
    if scheme.format == "pack-quantized":
        return {f"{prefix}.weight_packed": pack_int32(q.codes, scheme.bits),
                f"{prefix}.weight_scale": q.scale.contiguous(),
                f"{prefix}.weight_shape": torch.tensor(q.codes.shape, dtype=torch.int64)}
    return {f"{prefix}.weight": q.codes.contiguous(), f"{prefix}.weight_scale": q.scale.contiguous()}


def _args(kind: str, bits: int, strategy: str, group_size: int | None, dynamic: bool) -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": True, "group_size": group_size, "strategy": strategy,
            "dynamic": dynamic}


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict:
    """config.json's `quantization_config`, as llm-compressor writes it for `scheme`."""
    strategy = "channel" if scheme.group_size is None else "group"
    weights = _args(scheme.kind, scheme.bits, strategy, scheme.group_size, False)
    if scheme.actorder:
        weights["actorder"] = "weight"
    inputs = _args(scheme.kind, 8, "token", None, True) if scheme.dynamic_activations else None
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None,
             "format": scheme.format}
    return {"config_groups": {"group_0": group}, "format": scheme.format, "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": FORMAT_VERSION}
