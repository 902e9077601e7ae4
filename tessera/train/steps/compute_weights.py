"""bf16 (or fp16) compute copies of the weights, made once per optimizer step.

Under autocast every matrix product casts its fp32 weight to the compute dtype, again for every
micro-batch (autocast's cast cache lives only as long as one autocast region, one forward). Here
the casts happen once, at the start of a step's forward/backward (`refresh`, after the previous
optimizer step changed the fp32 master weights), and each micro-batch's forward runs the model
with the cached copies in place of the weights (`torch.func.functional_call`). Autocast stays on
for the activations, and casting an already-bf16 weight is free, so the arithmetic is the one
autocast does: the same rounded weights forward, and in backward each copy's gradient is cast to
fp32 and accumulated into the master weight's `.grad` (`_CachedCast`), as autocast's cast would.

Cached: the weights autocast would cast anyway, those of `nn.Linear` and `nn.Conv1d` layers (a
recurrent layer's short convolution) and of the routed experts (SwiGLU's and relu^2's). Not cached
(they stay fp32 as under autocast): the embedding (a lookup; with tied embeddings the head shares it
and autocast casts it there), norms, the router (fp32 by design) and expert biases. The copies cost
2 bytes per cached parameter between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from tessera.models.moe.biased_experts import BiasedExperts
from tessera.models.moe.experts import GroupedExperts, Relu2Experts


class _CachedCast(torch.autograd.Function):
    """Forward: the cached low-precision copy of `master`; backward: the gradient in the master's
    dtype (fp32), accumulated into `master.grad` by autograd."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.master_dtype), None


def cast_weight_names(model: nn.Module) -> list[str]:
    """Names of the parameters autocast would cast for a matrix product, except ones shared with
    the embedding (a tied head), which stays fp32 for the lookup."""
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    names = []
    for mod_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):  # (a recurrent layer's short convolution: conv1d)
            leaves = ("weight", "bias")
        elif isinstance(module, (GroupedExperts, Relu2Experts)):
            leaves = tuple(module.split_dims)
        elif isinstance(module, BiasedExperts):  # gpt-oss's: the products' weights, not their biases
            leaves = ("gate_up_proj", "down_proj")
        else:
            continue
        for leaf in leaves:
            p = getattr(module, leaf, None)
            if isinstance(p, nn.Parameter) and p.is_floating_point() and id(p) not in embedding:
                names.append(f"{mod_name}.{leaf}" if mod_name else leaf)
    return names


class CachedComputeWeights:
    """The compute copies of `model`'s matrix weights in `dtype`, and a forward that uses them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.names = cast_weight_names(model)
        self.copies: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every cached weight from its current fp32 value (once per optimizer step)."""
        params = dict(self.model.named_parameters())
        self.copies = {n: params[n].detach().to(self.dtype) for n in self.names}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """`model(*args, **kwargs)` computing with the cached copies."""
        if not self.copies:
            self.refresh()
        params = dict(self.model.named_parameters())
        swapped = {n: _CachedCast.apply(params[n], c) for n, c in self.copies.items()}
        return functional_call(self.model, swapped, args, kwargs, tie_weights=False, strict=False)
