"""RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, computed in fp32.

With `unit_offset` (Gemma 3, Qwen3-Next) the scale is (1 + weight), the weight starting at 0, and
the product is taken in fp32 before the cast back, as those models' HuggingFace classes do."""

from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        # (x, weight, eps) -> the same values in one call, used without autograd: serving on CPU
        # installs a one-pass kernel (tessera.infer.cpu.layer_ops) where the norm has no offset; None elsewhere
        self.fused: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    @property
    def initial_weight(self) -> float:
        """The value every weight starts at: the identity scale."""
        return 0.0 if self.unit_offset else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and not self.unit_offset and not torch.is_grad_enabled():
            return self.fused(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)
