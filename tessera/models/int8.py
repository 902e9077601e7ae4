"""Weight-only int8 layers with one scale per output channel.

W (out x in) is stored as int8 Q and fp32 scales s (out): s_o = max_i |W_oi| / 127,
Q = round(W / s). A linear layer computes y = (x Q^T) * s (+ b), which is exactly x (Q * s)^T:
the scale factors out of the sum because it belongs to the output channel (symmetric absmax,
as in LLM.int8()'s vector-wise quantisation, Dettmers et al. 2022, without its outlier split).
Routed experts ([E, out, in]) get one scale per (expert, output channel). The embedding (a table
lookup, not a product), norms, the router and the output head stay in full precision: the head
and the router are where rounding hurts most (logits and expert choices).

Quantized layers take a quarter of their fp32 memory (half of bf16). A model served on CPU in fp32
multiplies by the codes without dequantizing them (the `fused` seam, tessera.infer.cpu.quant_matmul).
`quantize_layers` converts a model in place (called as `quantize_model(model, "int8")`, tessera/models/quantized.py);
`empty_int8_layer` is the storage-free int8 twin of a layer, which the pre-quantized directory
format (tessera/checkpoint/int8.py) fills from its files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.moe.experts import GroupedExperts, grouped_linear
from tessera.models.transformer import Transformer


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 scales over the last dim: w [..., out, in] -> q [..., out, in], s [..., out]."""
    w = w.float()
    scale = w.abs().amax(-1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class FrozenWeightProduct(torch.autograd.Function):
    """A quantized layer's product where autograd needs the input's gradient (QLoRA: train.lora.quantize_base):
    the full-precision weight it computes with is made again in backward from the codes, not saved, so a
    forward and backward over the whole model never holds the dequantized weights of every layer at
    once. The codes take no gradient; a bias that requires one gets it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, layer: nn.Module) -> torch.Tensor:
        ctx.layer, ctx.x_dtype = layer, x.dtype
        ctx.bias_grad = bias is not None and bias.requires_grad
        return layer.product(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = ctx.layer.input_grad(dy).to(ctx.x_dtype)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.bias_grad else None
        return dx, db, None


# The `fused` seam of a quantized linear layer: (layer, x) -> y, or None to take the layer's own
# product. None on the class; tessera.infer.cpu.quant_matmul sets it per layer of a model the engine
# owns on CPU in fp32, to multiply by the codes where they lie (GgufLinear.fused's twin).
FusedProduct = Callable[[nn.Module, torch.Tensor], "torch.Tensor | None"]


def fused_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer.fused(layer, x)` where a kernel is installed and takes `x`, else None."""
    fused = getattr(layer, "fused", None)
    return fused(layer, x) if fused is not None else None


def frozen_weight_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer.product(x)`, through FrozenWeightProduct where autograd wants the input's gradient;
    the installed kernel's product (`fused`) where there is one and it takes `x`."""
    if torch.is_grad_enabled() and (x.requires_grad or (layer.bias is not None and layer.bias.requires_grad)):
        return FrozenWeightProduct.apply(x, layer.bias, layer)
    y = fused_product(layer, x)
    return y if y is not None else layer.product(x)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one fp32 scale per output channel."""

    fused: FusedProduct | None = None  # the kernel seam (fused_product)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, m: nn.Linear) -> Int8Linear:
        q = cls(m.in_features, m.out_features, m.bias is not None, m.weight.dtype, m.weight.device)
        q.qweight, q.scale = quantize_per_channel(m.weight.detach())
        if m.bias is not None:
            q.bias = nn.Parameter(m.bias.detach().clone())
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_weight_forward(self, x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def input_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """d product / dx applied to `dy` (as autograd would: the scale, then the codes)."""
        return (dy * self.scale.to(dy.dtype)) @ self.qweight.to(dy.dtype)


class Int8GroupedExperts(GroupedExperts):
    """Routed experts with int8 weights, dequantised expert by expert inside the forward pass."""

    quantized = True  # not quantizable again (quantizable_layers)

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, dtype: torch.dtype, device=None):
        nn.Module.__init__(self)
        self.use_grouped_mm = True
        self.dtype = dtype
        for name, (o, i) in {"w1": (hidden_dim, dim), "w2": (dim, hidden_dim), "w3": (hidden_dim, dim)}.items():
            self.register_buffer(f"q{name}", torch.zeros(num_experts, o, i, dtype=torch.int8, device=device))
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, o, device=device))

    @classmethod
    def from_experts(cls, m: GroupedExperts) -> Int8GroupedExperts:
        E, F_, D = m.w1.shape
        q = cls(E, D, F_, m.w1.dtype, m.w1.device)
        for name in ("w1", "w2", "w3"):
            qw, s = quantize_per_channel(getattr(m, name).detach())
            setattr(q, f"q{name}", qw)
            setattr(q, f"{name}_scale", s)
        return q

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return getattr(self, f"q{name}").to(dtype) * getattr(self, f"{name}_scale")[..., None].to(dtype)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        d = x_ND.dtype
        h = F.silu(grouped_linear(x_ND, self._weight("w1", d), tokens_per_expert)) * grouped_linear(
            x_ND, self._weight("w3", d), tokens_per_expert)
        return grouped_linear(h, self._weight("w2", d), tokens_per_expert)


def quantizable_layers(model: Transformer) -> list[tuple[str, nn.Module]]:
    """Linear layers and routed experts inside the transformer blocks (not the head or router)."""
    out = []
    for name, m in model.named_modules():
        if not name.startswith("layers.") or ".router" in name:
            continue
        if isinstance(m, (nn.Linear, GroupedExperts)) and not getattr(m, "quantized", False):
            out.append((name, m))
    return out


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def quantize_layers(model: Transformer, linear_cls: type, experts_cls: type) -> list[str]:
    """Replace every quantizable layer of `model` by `linear_cls.from_linear(layer)` or
    `experts_cls.from_experts(experts)` (in place); returns their names."""
    names = []
    for name, m in quantizable_layers(model):
        new = linear_cls.from_linear(m) if isinstance(m, nn.Linear) else experts_cls.from_experts(m)
        replace_module(model, name, new)
        names.append(name)
    return names


def empty_int8_layer(m: nn.Module, dtype: torch.dtype) -> nn.Module | None:
    """An int8 layer of `m`'s shape (in the current default device), for a linear layer or routed
    experts; None for any other module."""
    if isinstance(m, nn.Linear):
        return Int8Linear(m.in_features, m.out_features, m.bias is not None, dtype)
    if isinstance(m, GroupedExperts):
        E, F_, D = m.w1.shape
        return Int8GroupedExperts(E, D, F_, dtype)
    return None
