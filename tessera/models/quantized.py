"""Weight-only fp8 and int4 layers, quantized at load by round-to-nearest, and `quantize_model`
for every method `--quantization` names (int8, fp8, int4).

fp8: W (out x in) is stored as float8_e4m3fn codes C and fp32 scales s (out), one per output
channel: s_o = max_i |W_oi| / 448 (448 is e4m3's largest finite value), C = W / s rounded to the
nearest e4m3 value (PyTorch's cast rounds to nearest, ties to even). 1 byte per weight; e4m3 keeps
3 mantissa bits, so a normal code is within 2^-4 of |W / s| relatively, a subnormal one within
2^-10 absolutely.

int4: symmetric round-to-nearest, group-wise along the input dim: groups of 128 inputs when 128
divides in_features, else one group per row (the whole in_features). Per (output channel, group),
s = max |W| / 7 and Q = round(W / s) in [-7, 7]. Symmetric, by choice: no zero-point tensor, and
dequantizing is one multiply; the price is code 0 (-8) left unused. Q + 8 (1..15) is kept
as an unsigned nibble, two per uint8 byte: column 2j in the low nibble, 2j + 1 in the high one. 0.5
byte per weight plus one fp32 scale per group. Each weight is within s / 2 of its dequantized value.

Both compute by the plain PyTorch reference: dequantize to the activations' dtype, then F.linear (where
autograd wants the input's gradient, QLoRA's training, the weight is dequantized again in backward
rather than saved: int8.FrozenWeightProduct)
(routed experts: dequantized expert by expert inside the grouped matmul). fp8 linear layers on a
CUDA GPU with FP8 tensor cores multiply through torch._scaled_mm instead (Fp8Linear), where the
shapes allow it; nothing requires it. int8 and int4 linear layers of a model served on CPU in fp32
multiply by their codes instead, read where they lie by the GGUF kernel's arithmetic (their `fused`
seam, tessera.infer.cpu.quant_matmul). As with int8 the embedding, norms, router and output head
stay in full precision (tessera/models/int8.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.choices import lookup_choice
from tessera.config.errors import ConfigError
from tessera.models.float8 import ALIGN, E4M3, to_float8
from tessera.models.int8 import FusedProduct, Int8GroupedExperts, Int8Linear, frozen_weight_forward, quantize_layers
from tessera.models.moe.experts import GroupedExperts
from tessera.models.transformer import Transformer

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper or newer
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT4_GROUP = 128


def int4_group_size(in_features: int) -> int:
    """128 when it divides `in_features`, else the whole row."""
    return INT4_GROUP if in_features % INT4_GROUP == 0 else in_features


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 scales over the last dim: w [..., out, in] -> c [..., out, in], s [..., out]."""
    w = w.float()
    scale = w.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)


def int4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed nibbles and fp32 group scales: w [..., out, in] -> p uint8 [..., out, in / 2],
    s [..., out, in / group]."""
    *lead, out_f, in_f = w.shape
    if in_f % 2:
        raise ConfigError(f"int4 packs two weights per byte: in_features={in_f} must be even")
    g = int4_group_size(in_f)
    wg = w.float().reshape(*lead, out_f, in_f // g, g)
    scale = wg.abs().amax(-1).clamp(min=1e-12) / 7.0
    q = (torch.round(wg / scale[..., None]).clamp(-7, 7) + 8).to(torch.uint8).reshape(*lead, out_f, in_f)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).float() - 8.0
    *lead, out_f, in_f = q.shape
    groups = scale.shape[-1]
    return (q.reshape(*lead, out_f, groups, in_f // groups) * scale[..., None]).reshape(q.shape).to(dtype)


class _Format:
    """How one method stores a weight [..., out, in]: its codes' dtype and shape, and its scales' shape."""

    def __init__(self, name, quantize, dequantize, code_dtype, code_cols, scale_cols):
        self.name, self.quantize, self.dequantize = name, quantize, dequantize
        self.code_dtype, self.code_cols, self.scale_cols = code_dtype, code_cols, scale_cols

    def empty(self, lead: tuple[int, ...], out_f: int, in_f: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.zeros(*lead, out_f, self.code_cols(in_f), device=device).to(self.code_dtype)
        cols = self.scale_cols(in_f)
        return codes, torch.ones(*lead, out_f, *((cols,) if cols else ()), device=device)


FP8 = _Format("fp8", fp8_quantize, fp8_dequantize, torch.float8_e4m3fn, lambda i: i, lambda i: 0)
INT4 = _Format("int4", int4_quantize, int4_dequantize, torch.uint8, lambda i: i // 2,
               lambda i: i // int4_group_size(i))


class _QuantizedLinear(nn.Module):
    """A linear layer whose weight is kept as `fmt` codes (`qweight`) and fp32 scales (`scale`)."""

    fmt: _Format
    fused: FusedProduct | None = None  # the kernel seam (int8.fused_product)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        codes, scale = self.fmt.empty((), out_features, in_features, device)
        self.register_buffer("qweight", codes)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, m: nn.Linear) -> _QuantizedLinear:
        q = cls(m.in_features, m.out_features, m.bias is not None, m.weight.dtype, m.weight.device)
        q.qweight, q.scale = q.fmt.quantize(m.weight.detach())
        if m.bias is not None:
            q.bias = nn.Parameter(m.bias.detach().clone())
        return q

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.fmt.dequantize(self.qweight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_weight_forward(self, x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """d product / dx applied to `dy`, with the weight dequantized again (int8.FrozenWeightProduct)."""
        return dy @ self.dequantized_weight(dy.dtype)


def fp8_tensor_cores(x: torch.Tensor, layer: Fp8Linear) -> bool:
    """Whether `layer`'s product with `x` runs on FP8 tensor cores (torch._scaled_mm): a CUDA
    device of compute capability >= 8.9 (not ROCm), x in bf16 or fp32, and in / out features
    multiples of 16 (what _scaled_mm takes), and the codes still e4m3 (`Module.to(dtype)` casts float8
    buffers like any floating-point tensor; the reference reads such codes exactly). Else the plain
    PyTorch reference runs."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and hasattr(torch, "_scaled_mm")
            and layer.qweight.dtype == torch.float8_e4m3fn
            and layer.in_features % ALIGN == 0 and layer.out_features % ALIGN == 0
            and torch.version.hip is None and torch.cuda.get_device_capability(x.device) >= FP8_MIN_CAPABILITY)


class Fp8Linear(_QuantizedLinear):
    """On CUDA with FP8 tensor cores (fp8_tensor_cores) the activations are cast to e4m3 with one
    dynamic scale per tensor (as train.fp8 does, tessera/models/float8.py) and multiplied by the
    stored codes; the per-channel weight scales are applied to the product's output columns, which
    is exact since each belongs to one output. Elsewhere: dequantize and F.linear."""

    fmt = FP8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_tensor_cores(x, self) or torch.is_grad_enabled():  # training: the reference's product
            return super().forward(x)
        x8, inv_x = to_float8(x.reshape(-1, self.in_features).contiguous(), E4M3)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(x8, self.qweight.t(), scale_a=inv_x, scale_b=one, out_dtype=x.dtype)
        y = (y * self.scale.to(x.dtype)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(_QuantizedLinear):
    fmt = INT4


class _QuantizedGroupedExperts(GroupedExperts):
    """Routed experts ([E, out, in] weights) kept as `fmt` codes and scales, dequantized inside the
    forward pass (the computation is Int8GroupedExperts', only the weight format differs)."""

    fmt: _Format
    quantized = True

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, dtype: torch.dtype, device=None):
        nn.Module.__init__(self)
        self.use_grouped_mm = True
        self.dtype = dtype
        for name, (o, i) in {"w1": (hidden_dim, dim), "w2": (dim, hidden_dim), "w3": (hidden_dim, dim)}.items():
            codes, scale = self.fmt.empty((num_experts,), o, i, device)
            self.register_buffer(f"q{name}", codes)
            self.register_buffer(f"{name}_scale", scale)

    @classmethod
    def from_experts(cls, m: GroupedExperts) -> _QuantizedGroupedExperts:
        E, F_, D = m.w1.shape
        q = cls(E, D, F_, m.w1.dtype, m.w1.device)
        for name in ("w1", "w2", "w3"):
            codes, scale = q.fmt.quantize(getattr(m, name).detach())
            setattr(q, f"q{name}", codes)
            setattr(q, f"{name}_scale", scale)
        return q

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.fmt.dequantize(getattr(self, f"q{name}"), getattr(self, f"{name}_scale"), dtype)

    forward = Int8GroupedExperts.forward


class Fp8GroupedExperts(_QuantizedGroupedExperts):
    fmt = FP8


class Int4GroupedExperts(_QuantizedGroupedExperts):
    fmt = INT4


LAYERS = {"int8": (Int8Linear, Int8GroupedExperts), "fp8": (Fp8Linear, Fp8GroupedExperts),
          "int4": (Int4Linear, Int4GroupedExperts)}


def quantize_model(model: Transformer, method: str = "int8") -> list[str]:
    """Replace every quantizable layer of `model` (the linear layers and routed experts of its blocks:
    attention, MLA, MLP, experts; not the router or head) by its `method` version, in place;
    returns their names."""
    return quantize_layers(model, *lookup_choice(LAYERS, method, "quantization"))

