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
