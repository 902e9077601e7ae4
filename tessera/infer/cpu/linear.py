"""Projections of a served model on CPU, with weights packed once at load for the kernel that multiplies.

`F.linear` on CPU multiplies by the weight as stored ([out, in], row-major) on every call; for the
few rows of a decode step (M = 1..64) that reads the weight in an order its kernels handle poorly.
`pack_linears(model)` packs each projection once for one of two kernels:
- the panel kernel (`csrc/linear_cpu.cpp`, in the library infer/cpu/attention.py builds): the weight as
  panels of 16 output columns, each [in, 16], read from start to end once per product through a
  register block of 6 rows by 16 columns. A decode step's few rows are bound by reading the
  weights, which it reads at the memory's pace: faster than oneDNN's linear over the same weights
  at one and a few rows, the gap closing as the rows grow to a few dozen, even with it for a prompt
  chunk (docs/benchmarks.md, "projections: panel kernel vs oneDNN", `bench/cpu_linear.py`);
- oneDNN's linear (`torch.ops.mkldnn._reorder_linear_weight`, the layout PyTorch's inductor uses
  when it freezes a CPU model), where the library does not build (no compiler) or is switched off
  (`TESSERA_CPU_ATTENTION=torch`): faster than `F.linear` over the weight as stored for the rows of
  a decode step (docs/benchmarks/2026-11-25-serving-vs-vllm-2-cpu-decode-path.md).

`pack_linears` replaces every plain `nn.Linear` of a model the engine owns (loaded by
`LLMEngine.from_dir`) by a `PanelLinear` (or `OneDNNLinear`) built over the same parameters, in its
parent: no copy, the same `state_dict`, and the same hooks (forward hooks, such as those of LoRA
adapters, still see it); the dense `weight` stays as it is for everything that reads it, so the
packed copy is a second copy of the projection weights (turned off by `EngineConfig.cpu_prepack=False`).
Quantized, sharded and other linear types are left alone. Results differ from `F.linear` by the
order of the sums (fp32 rounding, ~1e-6 relative); a model in training is never packed (the copy
would go stale with the first optimizer step). Only fp32 on CPU: elsewhere (CUDA, other dtypes)
nothing changes.

`fuse_projections(model)` then multiplies the projections that read the same input in one product:
an attention's q, k and v (`Attention.fused_qkv`) and an MLP's gate and up (`FeedForward.fused_gate_up`),
the models' `FusedProjection` seam. A product over the concatenated weight reads the input once and
runs one wide kernel instead of three (or two) narrow ones, which pays where the kernels are
short, the few rows of a decode step, and is lost in the noise on a prompt chunk
(docs/benchmarks/2026-11-27-serving-vs-vllm-4-attention-kernel.md, "q/k/v and gate/up fused").
The fused modules give their own packed copies up (each is replaced by a plain `nn.Linear` over
its parameters, with its hooks; the concatenated copy replaces theirs: still two copies of the
weights in all) and fall back to `F.linear` over their dense weights when they run alone, which
they do whenever a forward hook or pre-hook is on any of them (a LoRA adapter's: it must see each
module's own output).

A fused gate and up on the panel kernel also multiply as `FusedLinear.swiglu` (`panel_swiglu`): each
thread computes a gate panel and its up panel over all rows and writes silu(gate) * up, so the
[tokens, 2 x hidden] product is neither stored nor read back by a separate activation pass; the
same bits as the product then the layer kernel's silu_mul. `layer_ops.fuse_layer_ops` installs
it at `FeedForward.fused_swiglu`. It gains most where a step has few rows and the separate pass
would be a large share of its work, a decode step, and little on a prompt chunk, whose products
dominate (docs/benchmarks/2026-11-28-serving-vs-vllm-9-prompt-attention-swiglu.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.infer.cpu import attention as cpu_attention
from tessera.models.int8 import replace_module


def _panel_multiply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.tessera_cpu.panel_linear(x, packed, bias, n)


def _onednn_multiply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_over(kind: type[nn.Linear], linear: nn.Linear) -> nn.Linear:
    """A new `kind` module over `linear`'s own parameters (no copy: the state_dict's keys and values are
    `linear`'s), in its mode and with its hooks: the same hook tables, so a handle taken on `linear`
    still removes its hook. Built on the meta device, so `nn.Linear` allocates no weight of its own."""
    new = kind(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight, new.bias = linear.weight, linear.bias
    new.train(linear.training)
    for name, table in vars(linear).items():
        if "hook" in name:  # forward (pre-)hooks, backward and state_dict hooks, with their flags
            vars(new)[name] = table
    return new


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward multiplies by `packed`, its weight as `pack` lays it out, through
    `multiply` (x, packed, bias, out_features) -> y; the subclasses name a kernel."""

    packed: torch.Tensor
    pack: Callable[[torch.Tensor], torch.Tensor]
    multiply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]

    @classmethod
    def over(cls, linear: nn.Linear) -> PackedLinear:
        """`linear` as this type (`linear_over`), its weight packed once."""
        new = linear_over(cls, linear)
        new.packed = cls.pack(linear.weight.detach())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, self.packed, self.bias, self.out_features)


class PanelLinear(PackedLinear):
    """Packed in panels for the panel kernel (module docstring)."""

    # a lambda: the library's ops exist only once it is built, so they are looked up at the call
    pack = staticmethod(lambda w: torch.ops.tessera_cpu.pack_panels(w))
    multiply = staticmethod(_panel_multiply)


class OneDNNLinear(PackedLinear):
    """Packed in oneDNN's layout for its linear."""

    pack = staticmethod(lambda w: torch.ops.mkldnn._reorder_linear_weight(w))
    multiply = staticmethod(_onednn_multiply)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packing(onednn: bool = False) -> type[PackedLinear] | None:
    """The packed module type this process uses: the panel kernel's where the C++ library builds and
    is not switched off (and `onednn` is not asked for), else oneDNN's, else None."""
    if not onednn and cpu_attention.library_available():
        return PanelLinear
    if _onednn_available():
        return OneDNNLinear
    return None


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and _packing() is not None


@torch.no_grad()
def pack_linears(model: nn.Module, onednn: bool = False) -> int:
    """Replace every plain fp32 CPU `nn.Linear` below `model` by a `PanelLinear` over its parameters
    (or, without the panel kernel or with `onednn`, which benchmarks use to compare the two, a
    `OneDNNLinear`), under every name `model` holds it by; returns how many."""
    cls = _packing(onednn)
    if cls is None:
        return 0
    packed: dict[nn.Module, PackedLinear] = {}  # one packed module for a linear held under two names
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if name and _plain_fp32_cpu(module):
            if module not in packed:
                packed[module] = cls.over(module)
            replace_module(model, name, packed[module])
    return len(packed)


def _plain_fp32_cpu(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"


class FusedLinear:
    """`members` (linears over the same input) as one product of the kernel of `kind`, a packed type
    (default: the members' own): called with x, their outputs in order (views of one result), or None
    with gradients on or while a hook is on any member."""

    def __init__(self, members: list[nn.Linear], kind: type[PackedLinear] | None = None):
        kind = kind or type(members[0])
        self.multiply = kind.multiply
        self.packed = kind.pack(torch.cat([m.weight.detach() for m in members]))
        self.bias = None
        if any(m.bias is not None for m in members):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                                   for m in members])
        self.sizes = [m.out_features for m in members]
        self.members = members

    def _runs(self) -> bool:
        """False under autograd or while a hook is on a member (it must see that member's own call)."""
        return not torch.is_grad_enabled() and not any(m._forward_hooks or m._forward_pre_hooks for m in self.members)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if not self._runs():
            return None
        out = self.multiply(x, self.packed, self.bias, sum(self.sizes))
        return out.split(self.sizes, dim=-1)

    @property
    def has_swiglu(self) -> bool:
        """Whether `swiglu` can run: a gate and an up projection of one size, a multiple of 16, without
        biases, packed for the panel kernel."""
        return (self.multiply is _panel_multiply and len(self.sizes) == 2 and self.sizes[0] == self.sizes[1]
                and self.sizes[0] % 16 == 0 and self.bias is None)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of the two members (gate first) in one product that applies the activation
        to each block of sixteen columns as it is computed (`panel_swiglu`): the [tokens, 2 x hidden]
        product is never written out and read back. The same values as `__call__` then SwiGLU's
        kernel (tessera.infer.cpu.layer_ops); None where `__call__` would give None."""
        if not self._runs():
            return None
        return torch.ops.tessera_cpu.panel_swiglu(x, self.packed, self.sizes[0])


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Give every attention whose wq, wk, wv and every MLP whose w1, w3 are packed the same way (after
    `pack_linears`) one fused product (module docstring); returns how many were fused."""
    from tessera.models.attention import Attention
    from tessera.models.mlp import FeedForward

    n = 0
    for module in list(model.modules()):
        if isinstance(module, Attention):
            names, slot = ("wq", "wk", "wv"), "fused_qkv"
        elif isinstance(module, FeedForward):
            names, slot = ("w1", "w3"), "fused_gate_up"
        else:
            continue
        kind = type(getattr(module, names[0]))
        if not issubclass(kind, PackedLinear) or any(type(getattr(module, m)) is not kind for m in names):
            continue
        # the fused copy replaces theirs: alone they multiply by their dense weights, as plain nn.Linear
        plain = [linear_over(nn.Linear, getattr(module, m)) for m in names]
        for name, linear in zip(names, plain, strict=True):
            setattr(module, name, linear)
        setattr(module, slot, FusedLinear(plain, kind))
        n += 1
    return n
