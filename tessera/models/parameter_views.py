"""Whether a tensor autograd saves is model state: a parameter, or a cast or view of one.

A linear layer saves its weight (or, under autocast, the weight's bf16 copy) for backward; that is
the model's compute copy of its weights, not an activation. Both the activation offload
(tessera/parallel/memory/activation_offload.py), which leaves such tensors on the GPU, and the planner's
saved-tensor counter (tessera/plan/saved_tensors.py), which counts them as model state, ask here.
"""

from __future__ import annotations

import torch
from torch import nn

# Autograd nodes of casts and views: following them from a saved tensor leads to what it was made from.
_PASS_THROUGH = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0",
                 "ExpandBackward0", "UnsafeViewBackward0", "SelectBackward0", "SliceBackward0"}


def parameter_storages(module: nn.Module) -> set[int]:
    """The storage addresses of `module`'s parameters as they are now (under FSDP, inside a
    forward: the gathered ones)."""
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def derived_from_parameter(t: torch.Tensor, params: set[int]) -> bool:
    """True when `t` is one of `params` (storage addresses) or a cast or view of one, by its storage or
    its autograd history."""
    if t.untyped_storage().data_ptr() in params:
        return True
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _PASS_THROUGH:
        parents = [n for n, _ in fn.next_functions if n is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
    if fn is None or type(fn).__name__ != "AccumulateGrad":
        return False
    return fn.variable.untyped_storage().data_ptr() in params
