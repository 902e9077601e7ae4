"""Projections of a served model on CPU through oneDNN, with weights reordered once at load.

`F.linear` on CPU multiplies by the weight as stored ([out, in], row-major) on every call; for the
few rows of a decode step (M = 1..64) that reads the weight in an order its kernels handle poorly.
oneDNN's linear takes the weight reordered once into its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the same op PyTorch's inductor uses when it freezes a
CPU model) and multiplies by it directly. Measured on this project's 2-core machine: 2-3x faster
per projection at 8-32 rows, about 1.3x for a prompt chunk (docs/benchmarks.md).

`pack_linears(model)` turns every plain `nn.Linear` of a model the engine owns (loaded by
`LLMEngine.from_dir`) into a `OneDNNLinear` in place (the modules keep their identity, so forward
hooks, such as those of LoRA adapters, still see them); the dense `weight` stays as it is for
everything that reads it, so the packed copy is a second copy of the projection weights (turned off
by `EngineConfig.cpu_prepack=False`). Quantized, sharded and other linear types are left alone.
Results differ from `F.linear` by the order of the sums (fp32 rounding, ~1e-6 relative); a model
in training is never packed (the copy would go stale with the first optimizer step).
Only fp32 on CPU: elsewhere (CUDA, other dtypes) nothing changes.

`fuse_projections(model)` then multiplies the projections that read the same input in one product:
an attention's q, k and v (`Attention.fused_qkv`) and an MLP's gate and up (`FeedForward.fused_gate_up`),
the models' `FusedProjection` seam. A product over the concatenated weight reads the input once and
runs one wide kernel instead of three (or two) narrow ones; measured on this project's 2-core
machine over 12 layers of the 110M model (docs/benchmarks.md): 1 row 14.5 -> 13.4 ms, 8 rows 19.4 ->
17.4 ms, 256 rows 221 -> 212 ms. The fused modules give their own packed copies up (the concatenated
one replaces them: still two copies of the weights in all) and fall back to `F.linear` over their
dense weights when they run alone, which they do whenever a forward hook or pre-hook is on any of
them (a LoRA adapter's: it must see each module's own output).
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose forward multiplies by `packed`, its weight in oneDNN's layout."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Make every plain fp32 CPU `nn.Linear` of `model` a `OneDNNLinear`; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
            continue
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
        module.__class__ = OneDNNLinear
        n += 1
    return n


class FusedLinear:
    """`members` (nn.Linear over the same input) as one oneDNN product: called with x, their outputs
    in order (views of one result), or None with gradients on or while a hook is on any member."""

    def __init__(self, members: list[nn.Linear]):
        weights = torch.cat([m.weight.detach() for m in members])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weights)
        self.bias = None
        if any(m.bias is not None for m in members):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                                   for m in members])
        self.sizes = [m.out_features for m in members]
        self.members = members

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if torch.is_grad_enabled() or any(m._forward_hooks or m._forward_pre_hooks for m in self.members):
            return None  # autograd, or a hook that must see each member's own call
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.split(self.sizes, dim=-1)


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Give every attention whose wq, wk, wv and every MLP whose w1, w3 are `OneDNNLinear`s (after
    `pack_linears`) one fused product (module docstring); returns how many were fused."""
    from tessera.models.attention import Attention
    from tessera.models.mlp import FeedForward

    n = 0
    for module in model.modules():
        if isinstance(module, Attention):
            members, slot = [module.wq, module.wk, module.wv], "fused_qkv"
        elif isinstance(module, FeedForward):
            members, slot = [module.w1, module.w3], "fused_gate_up"
        else:
            continue
        if not all(type(m) is OneDNNLinear for m in members):
            continue
        setattr(module, slot, FusedLinear(members))
        for m in members:  # the fused copy replaces theirs; alone they multiply by their dense weights
            del m.packed
            m.__class__ = nn.Linear
        n += 1
    return n
