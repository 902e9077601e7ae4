"""Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): w2(act(w1 x) * w3 x), SwiGLU
(act = silu) or GeGLU with the tanh-approximated GELU (Gemma 3), `ModelConfig.activation`; and the
ungated relu(x)^2 MLP of Nemotron-H ("relu2", `PlainFeedForward`)."""

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


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class PlainFeedForward(nn.Module):
    """An ungated MLP, w2(relu(w1 x)^2) (Nemotron-H's, `ModelConfig.activation` "relu2"): w1 up, w2 down."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(relu_squared(self.w1(x)))


def feed_forward(dim: int, hidden_dim: int, activation: str) -> nn.Module:
    """The dense MLP `activation` names: gated (FeedForward), or ungated for "relu2"."""
    return PlainFeedForward(dim, hidden_dim) if activation == "relu2" else FeedForward(dim, hidden_dim, activation)
