"""Tessera's own quantized layers on CPU multiplied by their codes, without dequantizing the matrix.

`--quantization int8|int4` (tessera/models/int8.py, quantized.py) and compressed-tensors checkpoints
(tessera/models/stored_quant.py: W4A16 / W8A16 `pack-quantized`, W8A8 `int-quantized`) compute by
the plain PyTorch reference: the whole weight dequantized to fp32 in every forward, then F.linear.
`use_quant_kernels(model)` repacks each such layer once, at load, into the blocks of two types the
GGUF kernel (`csrc/gguf_matmul_cpu.cpp`, tessera.infer.cpu.gguf_matmul) multiplies, and installs
`quant_product` at the layer's `fused` seam (int8.fused_product):

- "I8": 32 signed int8 codes and two fp32 factors (f, c): weight = f * q + c. int8 per channel (c = 0),
  compressed-tensors' 8-bit codes with a zero point z (c = -f * z), W8A8's int8 weight.
- "I4": 32 unsigned nibbles (GGUF's Q4 order) and (f, c): weight = f * w + c, w in 0..15. Tessera's
  int4 (w = Q + 8, c = -8 f) and compressed-tensors' 4-bit codes (stored offset by 8, c = -f (8 + z)).

f is the layer's fp32 scale of the 32 inputs (one per channel, or per group), so a layer repacks
exactly only where every 32 inputs share one scale: in_features and the group size multiples of 32,
no activation ordering (`weight_g_idx`). `REPACK` maps each layer type to its repacker, which returns
None where the layout does not allow it: that layer keeps the reference (`skipped` says which and why).
The product is the GGUF kernel's: activations rounded to int16 per 32 inputs, integer products,
factors applied per 32, each output by one thread in a fixed order (the same bits for any thread
count); it differs from the dequantized reference by the activations' rounding only (the bound of
gguf_matmul's docstring; W8A8's input is rounded to int8 by its scheme first, as in the reference).
Decode steps and prompt chunks up to `gguf_matmul.MAX_ROWS` rows take it; longer chunks, autograd
and non-fp32 inputs take the reference. Memory: the blocks (1.25 bytes a weight for I8, 0.75 for I4)
sit beside the layer's own codes, which stay for its state_dict and the reference (as the packed
fp32 copy of tessera.infer.cpu.linear does). The engine installs it with its other CPU kernels
(`LLMEngine.from_model`, an owned model): `--no-cpu-prepack` or `TESSERA_CPU_ATTENTION=torch` leave the
reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS, gguf_linear
from tessera.models.int8 import Int8Linear
from tessera.models.quantized import Int4Linear
from tessera.models.stored_quant import IntQuantizedLinear, PackedIntLinear, unpack_int32

QK = 32  # inputs per block
log = logging.getLogger("tessera.infer")


def blocks(kind: str, codes: torch.Tensor, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`kind` ("I8" or "I4") blocks [out, in / 32 * bytes] uint8 from integer codes [out, in] (int8
    values, or nibbles 0..15) and fp32 factors f, c [out, in / 32]."""
    out_f, in_f = codes.shape
    nb = in_f // QK
    v = codes.reshape(out_f, nb, QK)
    if kind == "I8":
        vals = v.to(torch.int8).view(torch.uint8)
    else:
        v = v.to(torch.uint8)
        vals = v[..., :16] | (v[..., 16:] << 4)
    factors = torch.stack((f.float(), c.float()), -1).contiguous().view(torch.uint8)  # [out, nb, 8]
    return torch.cat((vals, factors), -1).reshape(out_f, -1).contiguous()


def per_block(scale: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor | None:
    """fp32 factors [out, in / 32] from a scale of one column per group ([out or 1, G]), or None where
    a group is not whole blocks."""
    groups = scale.shape[-1]
    if in_f % QK or in_f % groups or (in_f // groups) % QK:
        return None
    return scale.float().expand(out_f, groups).repeat_interleave(in_f // groups // QK, dim=1)


def int8_blocks(layer: Int8Linear) -> tuple[str, torch.Tensor] | str:
    f = per_block(layer.scale[:, None], layer.out_features, layer.in_features)
    if f is None:
        return f"in_features={layer.in_features} is not a multiple of {QK}"
    return "I8", blocks("I8", layer.qweight, f, torch.zeros_like(f))


def int4_blocks(layer: Int4Linear) -> tuple[str, torch.Tensor] | str:
    f = per_block(layer.scale, layer.out_features, layer.in_features)
    if f is None:
        return f"in_features={layer.in_features} with groups of {layer.in_features // layer.scale.shape[-1]} " \
               f"is not whole blocks of {QK}"
    p = layer.qweight
    codes = torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)  # Q + 8, column order restored
    return "I4", blocks("I4", codes, f, -8.0 * f)


def packed_int_blocks(layer: PackedIntLinear) -> tuple[str, torch.Tensor] | str:
    if hasattr(layer, "weight_g_idx"):
        return "activation ordering (weight_g_idx) puts a group's inputs apart"
    out_f, in_f = layer.out_features, layer.in_features
    f = per_block(layer.weight_scale, out_f, in_f)
    if f is None or layer.num_bits not in (4, 8):
        return f"{layer.num_bits}-bit codes in groups of {layer.group_size} over in_features={in_f}: " \
               f"4 or 8 bits and groups of whole blocks of {QK} only"
    q = unpack_int32(layer.weight_packed, layer.num_bits, in_f)  # signed codes, float
    z = torch.zeros_like(f)
    if hasattr(layer, "weight_zero_point"):
        zp = unpack_int32(layer.weight_zero_point.t(), layer.num_bits, out_f).t()  # [out, G]
        z = per_block(zp, out_f, in_f)
    if layer.num_bits == 8:
        return "I8", blocks("I8", q, f, -f * z)
    return "I4", blocks("I4", q + 8, f, -f * (z + 8))


def int_quantized_blocks(layer: IntQuantizedLinear) -> tuple[str, torch.Tensor] | str:
    out_f, in_f = layer.out_features, layer.in_features
    f = per_block(layer.weight_scale, out_f, in_f)
    if f is None:
        return f"in_features={in_f} is not a multiple of {QK}"
    z = torch.zeros_like(f)
    if hasattr(layer, "weight_zero_point"):
        z = per_block(layer.weight_zero_point.float(), out_f, in_f)
    return "I8", blocks("I8", layer.weight, f, -f * z)


# Each layer type that repacks, and its repacker: (kind, blocks), or why it cannot (the reference stays).
REPACK: dict[type, Callable[[nn.Module], tuple[str, torch.Tensor] | str]] = {
    Int8Linear: int8_blocks,
    Int4Linear: int4_blocks,
    PackedIntLinear: packed_int_blocks,
    IntQuantizedLinear: int_quantized_blocks,
}


def quant_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer`'s product by its repacked blocks (a `fused` seam), or None where the reference takes it:
    autograd on, activations not fp32 on CPU, more than MAX_ROWS rows."""
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
            or x.numel() > MAX_ROWS * x.shape[-1]):
        return None
    bias = layer.bias.detach() if layer.bias is not None else None
    return gguf_linear(x, layer.kernel_blocks, layer.kernel_kind, layer.out_features, bias)


def install(layer: nn.Module) -> str | None:
    """Repack `layer` and set its `fused` seam; returns why not where it cannot."""
    packed = REPACK[type(layer)](layer)
    if isinstance(packed, str):
        return packed
    layer.kernel_kind, layer.kernel_blocks = packed
    layer.fused = quant_product
    return None


def use_quant_kernels(model: nn.Module) -> tuple[int, dict[str, str]]:
    """Install `quant_product` at every CPU layer of `model` whose type is in `REPACK` and whose layout
    repacks; returns how many, and the skipped layers' names with the reason (logged in one line; none
    where the library is not available: then nothing is installed)."""
    if not cpu_attention.library_available():
        return 0, {}
    done, skipped = 0, {}
    for name, m in model.named_modules():
        if type(m) not in REPACK or any(b.device.type != "cpu" for b in m.buffers()):
            continue
        why = install(m)
        if why is None:
            done += 1
        else:
            skipped[name] = why
    if skipped:  # one line: the first such layer names the reason (they share a shape)
        first = next(iter(skipped))
        log.warning("%d quantized layers keep the dequantizing product on CPU (%s: %s)", len(skipped), first,
                    skipped[first])
    return done, skipped
