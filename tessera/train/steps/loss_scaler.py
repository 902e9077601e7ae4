"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
scale S moves the backward pass's values into fp16's range; the fp32 gradients are divided by S
again before clipping and the optimizer step, so the update is the one an unscaled run makes.
S is dynamic: a step whose gradient holds inf/NaN (S too large) is skipped and S is halved
(`backoff_factor`); after `growth_interval` finite steps in a row S is doubled (`growth_factor`),
so it stays near the largest value that does not overflow.

The scale must multiply the loss itself, in fp32, before backward reaches anything fp16: the
fp16 logits' gradient is rounded to fp16 by the backward of the loss's cast to fp32, so a scale
applied to it afterwards would find its small entries zero already. Every step engine receives
the scaler (None outside fp16) and applies it where its loss is made:

- `SingleProcessStep`, `ParallelStep`: `scale_loss` on each micro-batch's objective
  (step_engine.accumulate_micro_batches);
- `PipelineStep`: `scale_loss` on what the schedule's loss function returns for the last stage
  (pipeline_step.PipelineLoss), and `scale_grad` on every stage's auxiliary loss (an fp32 scalar)
  before it rides on the stage output (tessera.parallel.pipeline, `aux_grad_scale`).

The trainer's step then divides the gradients by S (`unscale_`), measures the global gradient
norm, skips the update if it is not finite and calls `update`. The norm is reduced over all
ranks, so every rank (every pipeline stage too) skips, backs off and grows alike.

    scaler = DynamicLossScaler()
    scaler.scale_loss(objective(model(ModelInput(tokens=x, targets=y)))).backward()
    scaler.unscale_(parts)                                        # grads back to their true size
    norm = clip(...); skipped = not isfinite(norm); scaler.update(found_inf=skipped)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

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

    def scale_grad(self, x: torch.Tensor) -> torch.Tensor:
        """`x` unchanged; its gradient multiplied by the scale in backward (x as is where no
        backward will run: no gradient recorded, or `x` needs none)."""
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x
        return _ScaleGrad.apply(x, self.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale, for backward (as it is where no gradient is recorded)."""
        return loss * self.scale if torch.is_grad_enabled() and loss.requires_grad else loss

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
