"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
scale S moves the backward pass's values into fp16's range; the fp32 gradients are divided by S
again before clipping and the optimizer step, so the update is the one an unscaled run makes.
S is dynamic: a step whose gradient holds inf/NaN (S too large) is skipped and S is halved
(`backoff_factor`); after `growth_interval` finite steps in a row S is doubled (`growth_factor`),
so it stays near the largest value that does not overflow.

The loss is a function of the model's outputs only (`logits`, or `loss_sum` when the model
computes its chunked LM-head loss itself, and `aux_loss` of `ModelOutput`: tessera.train.loss),
so scaling the gradient that flows into those outputs is the same as scaling the loss, and needs
no change to any step engine: `attach` adds a forward hook on each model part that routes them
through an identity whose backward multiplies by S.

    scaler = DynamicLossScaler(); scaler.attach(parts)
    engine.forward_backward(batch); scaler.unscale_(parts)        # grads back to their true size
    norm = clip(...); skipped = not isfinite(norm); scaler.update(found_inf=skipped)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@dataclasses.dataclass
class DynamicLossScaler:
    """GradScaler-like dynamic loss scale; defaults are torch.amp.GradScaler's."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    good_steps: int = 0  # finite steps since the last change of scale

    def scale_outputs(self, module: nn.Module, args: Any, out: Any) -> Any:
        """Forward hook: the model output with `logits`, `loss_sum` and `aux_loss` scaled in backward."""
        if not torch.is_grad_enabled() or not dataclasses.is_dataclass(out):
            return out
        changes = {name: _ScaleGrad.apply(getattr(out, name), self.scale) for name in ("logits", "loss_sum", "aux_loss")
                   if isinstance(getattr(out, name, None), torch.Tensor) and getattr(out, name).requires_grad}
        return dataclasses.replace(out, **changes) if changes else out

    def attach(self, modules: Iterable[nn.Module]) -> None:
        for m in modules:
            m.register_forward_hook(self.scale_outputs)

    @torch.no_grad()
    def unscale_(self, modules: Iterable[nn.Module]) -> None:
        """Divide every gradient by the scale the step's backward ran with."""
        inv = 1.0 / self.scale
        for m in modules:
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(inv)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on inf/NaN (the step was skipped), grow after enough good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
