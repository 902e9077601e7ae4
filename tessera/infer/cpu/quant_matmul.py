"""Tessera's own quantized layers on CPU multiplied by their codes where they lie, without dequantizing the matrix.

`--quantization int8|int4` (tessera/models/int8.py, quantized.py) and compressed-tensors checkpoints
(tessera/models/stored_quant.py: W4A16 / W8A16 `pack-quantized`, W8A8 `int-quantized`) compute by
the plain PyTorch reference: the whole weight dequantized to fp32 in every forward, then F.linear.
`use_quant_kernels(model)` installs `quant_product` at each such layer's `fused` seam
(int8.fused_product), which multiplies by the layer's own buffers through the CPU library's
`quant_linear` (`csrc/quant_matmul_cpu.cpp`, the arithmetic of the GGUF kernel's blocks,
tessera.infer.cpu.gguf_matmul): the codes tensor read in place as bytes, in one of three layouts,

- "I8": signed int8 codes (Int8Linear's `qweight`, W8A8's int8 `weight`),
- "U8": bytes holding code + 128 (compressed-tensors' 8-bit codes in their int32 words),
- "P4": nibble pairs, input 2k low and 2k + 1 high (Tessera's int4 `qweight`, compressed-tensors' 4-bit words),

and the layer's fp32 scale [out or 1, G] read in place too: weight = f * w + c per input, f the scale of its
group, c = -offset * f (int4's code offset of 8), or the `kernel_shift` of a layer with zero points
([out or 1, G] fp32, -f * z, made once at install: the only tensor the kernel adds, G values a row).
Nothing else is kept for the kernel, so a served layer holds one copy of its codes (no repacked twin);
everything that reads the codes (export, LoRA, sleep, training, the GPU) reads the same buffers, and a
buffer replaced later is the one read next.

The kernel works only where every 32 inputs share one scale: in_features and the group size multiples
of 32, no activation ordering (`weight_g_idx`). `LAYOUTS` maps each layer type to its reader, which
returns why not where the layout does not allow it: that layer keeps the reference (`skipped` says which
and why). The product is the GGUF kernel's: activations rounded to int16 per 32 inputs, integer
products, factors applied per 32, each output by one thread in a fixed order (the same bits for any
thread count, and the bits the same weights gave repacked into the I8 / I4 blocks, which is how they were
served before); it differs from the dequantized reference by the activations' rounding only (the bound
of gguf_matmul's docstring; W8A8's input is rounded to int8 by its scheme first, as in the reference).
Decode steps and prompt chunks up to `gguf_matmul.MAX_ROWS` rows take it; longer chunks, autograd and
non-fp32 inputs take the reference. The engine installs it with its other CPU kernels
(`LLMEngine.from_model`, an owned model): `--no-cpu-prepack` or `TESSERA_CPU_ATTENTION=torch` leave the
reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS
from tessera.models.int8 import Int8Linear
from tessera.models.quantized import Int4Linear
from tessera.models.stored_quant import IntQuantizedLinear, PackedIntLinear, unpack_int32

QK = 32  # inputs per sub-block
log = logging.getLogger("tessera.infer")


@dataclass(frozen=True)
class Codes:
    """Where a layer's codes and scale lie for `quant_linear`: the names of its codes buffer and its
    scale buffer, their layout (module docstring), and the code offset (c = -offset * f) where the
    layer has no zero points."""

    layout: str
    codes: str
    scale: str
    offset: float = 0.0


def quant_linear(x: torch.Tensor, codes: torch.Tensor, layout: str, scale: torch.Tensor, shift: torch.Tensor | None,
                 offset: float, out_features: int, bias: torch.Tensor | None = None,
                 portable: bool = False) -> torch.Tensor:
    """x [..., in] (fp32, CPU) times the weight held as `codes` in `layout` with fp32 `scale` [out or 1, G]
    (and `shift`, or c = -offset * f), plus `bias`: [..., out]. `portable`: the portable loops (the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.tessera_cpu.quant_linear(rows, codes, layout, scale, shift, offset, out_features, bias, portable)
    return y.reshape(*x.shape[:-1], out_features)


def _whole_blocks(in_f: int, groups: int) -> bool:
    return in_f % QK == 0 and in_f % groups == 0 and (in_f // groups) % QK == 0


def _zero_shift(scale: torch.Tensor, z: torch.Tensor, offset: float) -> torch.Tensor:
    """-f * (z + offset) per (row, group), fp32: the constant term of a layer with zero points z [rows, G]."""
    f = scale.float().expand(z.shape[0], scale.shape[-1])
    return (-f * (z.float() + offset) if offset else -f * z.float()).contiguous()


def int8_codes(layer: Int8Linear) -> tuple[Codes, None] | str:
    if layer.in_features % QK:
        return f"in_features={layer.in_features} is not a multiple of {QK}"
    return Codes("I8", "qweight", "scale"), None


def int4_codes(layer: Int4Linear) -> tuple[Codes, None] | str:
    if not _whole_blocks(layer.in_features, layer.scale.shape[-1]):
        return f"in_features={layer.in_features} with groups of {layer.in_features // layer.scale.shape[-1]} " \
               f"is not whole blocks of {QK}"
    return Codes("P4", "qweight", "scale", 8.0), None


def packed_int_codes(layer: PackedIntLinear) -> tuple[Codes, torch.Tensor | None] | str:
    if hasattr(layer, "weight_g_idx"):
        return "activation ordering (weight_g_idx) puts a group's inputs apart"
    out_f, in_f, bits = layer.out_features, layer.in_features, layer.num_bits
    if not _whole_blocks(in_f, layer.weight_scale.shape[-1]) or bits not in (4, 8):
        return f"{bits}-bit codes in groups of {layer.group_size} over in_features={in_f}: " \
               f"4 or 8 bits and groups of whole blocks of {QK} only"
    codes = Codes("P4", "weight_packed", "weight_scale", 8.0) if bits == 4 else \
        Codes("U8", "weight_packed", "weight_scale")
    if not hasattr(layer, "weight_zero_point"):
        return codes, None
    z = unpack_int32(layer.weight_zero_point.t(), bits, out_f).t()  # [out, G], signed
    return codes, _zero_shift(layer.weight_scale, z, codes.offset)


def int_quantized_codes(layer: IntQuantizedLinear) -> tuple[Codes, torch.Tensor | None] | str:
    if layer.in_features % QK:
        return f"in_features={layer.in_features} is not a multiple of {QK}"
    codes = Codes("I8", "weight", "weight_scale")
    if not hasattr(layer, "weight_zero_point"):
        return codes, None
    return codes, _zero_shift(layer.weight_scale, layer.weight_zero_point, 0.0)


# Each layer type the kernel reads, and its reader: (Codes, shift or None), or why it cannot (the reference stays).
LAYOUTS: dict[type, Callable[[nn.Module], tuple[Codes, torch.Tensor | None] | str]] = {
    Int8Linear: int8_codes,
    Int4Linear: int4_codes,
    PackedIntLinear: packed_int_codes,
    IntQuantizedLinear: int_quantized_codes,
}


def quant_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer`'s product by its codes where they lie (a `fused` seam), or None where the reference takes
    it: autograd on, activations not fp32 on CPU, more than MAX_ROWS rows."""
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
            or x.numel() > MAX_ROWS * x.shape[-1]):
        return None
    codes: Codes = layer.kernel_codes
    buffers = layer._buffers  # read each call (a buffer replaced later is the one read), without Module.__getattr__
    scale, bias = buffers[codes.scale], layer.bias
    if scale.dtype != torch.float32:
        scale = scale.float()
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.tessera_cpu.quant_linear(rows, buffers[codes.codes], codes.layout, scale, layer.kernel_shift,
                                           codes.offset, layer.out_features, None if bias is None else bias.detach())
    return y.view(*x.shape[:-1], layer.out_features)


def install(layer: nn.Module) -> str | None:
    """Set `layer`'s `fused` seam to `quant_product` (and what it reads: `kernel_codes`, `kernel_shift`);
    returns why not where it cannot."""
    found = LAYOUTS[type(layer)](layer)
    if isinstance(found, str):
        return found
    layer.kernel_codes, layer.kernel_shift = found
    layer.fused = quant_product
    return None


def use_quant_kernels(model: nn.Module) -> tuple[int, dict[str, str]]:
    """Install `quant_product` at every CPU layer of `model` whose type is in `LAYOUTS` and whose layout
    the kernel reads; returns how many, and the skipped layers' names with the reason (logged in one
    line; none where the library is not available: then nothing is installed)."""
    if not cpu_attention.library_available():
        return 0, {}
    done, skipped = 0, {}
    for name, m in model.named_modules():
        if type(m) not in LAYOUTS or any(b.device.type != "cpu" for b in m.buffers()):
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
