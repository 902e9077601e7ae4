"""RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # (x, weight, eps) -> the same values in one call, used without autograd: serving on CPU
        # installs a one-pass kernel (tessera.infer.cpu.layer_ops); None everywhere else
        self.fused: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and not torch.is_grad_enabled():
            return self.fused(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
