"""Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): w2(act(w1 x) * w3 x), SwiGLU
(act = silu) or GeGLU with the tanh-approximated GELU (Gemma 3), `ModelConfig.activation`."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.attention import FusedProjection

ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu"):
        super().__init__()
        self.activation = activation  # the fused kernels below are SwiGLU's: installed only for silu
        self.act = ACTIVATION_FUNCTIONS[activation]
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.fused_gate_up: FusedProjection | None = None  # w1 and w3 in one product (models/attention.py)
        # (gate, up) -> silu(gate) * up in one call where the fused product runs: serving on CPU
        # installs a one-pass kernel (tessera.infer.cpu.layer_ops); None everywhere else
        self.fused_act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # x -> silu(w1 x) * w3 x in one product whose epilogue applies the activation (serving on CPU
        # with the panel kernel, tessera.infer.cpu.linear); it answers None where it cannot run (autograd,
        # a hook on w1 or w3), and the fused product or the plain modules take over
        self.fused_swiglu: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.fused_swiglu(x) if self.fused_swiglu is not None else None
        if act is not None:
            return self.w2(act)
        gate_up = self.fused_gate_up(x) if self.fused_gate_up is not None else None
        if gate_up is not None:
            # serving (no autograd): silu and the product in the fused result's own buffer, two fewer
            # [tokens, hidden_dim] allocations per layer; the same values
            gate, up = gate_up
            if self.activation != "silu":
                return self.w2(self.act(gate).mul_(up))
            if self.fused_act is not None:
                return self.w2(self.fused_act(gate, up))
            return self.w2(F.silu(gate, inplace=True).mul_(up))
        return self.w2(self.act(self.w1(x)) * self.w3(x))
