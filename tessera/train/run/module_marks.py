"""Compute by kind on the profiled steps (`tessera train --profile A:B`): module hooks, installed on the
model's modules only while a step is recorded and removed after it, make each attention, MLP /
experts, norm and LM-head module's forward and backward one `module` interval named by its kind
(`attention`, `mlp`, `norm`, `loss`), beside the `compute` intervals of profile_record.py.

A module's kind comes from its attribute name or class (`kind_of`); a module inside one already being
timed (a norm inside attention, the experts inside an MoE layer, a block recomputed inside another's
backward) is not timed again: at any instant at most one module interval is open, so the kinds never
count the same time twice. The cross-entropy outside the model is a `loss` interval too (its
`mark("module", "loss")` in the step engine); the rest of compute (embeddings, residual adds, the
host work between micro-batches, the cross-entropy's backward) is what the analysis calls `other`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import nn

KINDS = ("attention", "mlp", "norm", "loss")
_ATTENTION = {"attention", "self_attn", "attn", "cross_attn"}
_MLP = {"feed_forward", "moe", "mlp", "experts", "shared_experts", "ffn"}
_LOSS = {"output", "lm_head"}


def kind_of(name: str, module: nn.Module) -> str | None:
    """The kind of the module at `name` (its path in the model), or None: not one of KINDS."""
    leaf, cls = name.rsplit(".", 1)[-1], type(module).__name__
    if "Norm" in cls or leaf.endswith("norm"):
        return "norm"
    if leaf in _ATTENTION or cls.endswith(("Attention", "DeltaNet")):
        return "attention"
    if leaf in _MLP or cls in ("FeedForward", "MoE", "GroupedExperts"):
        return "mlp"
    if leaf in _LOSS and isinstance(module, nn.Linear):
        return "loss"
    return None


class ModuleMarks:
    """The hooks of one recorder: `install(modules)` when a recorded step begins, `remove()` after it.
    `add(kind, name, t0, t1, **fields)` is the recorder's."""

    def __init__(self, add: Callable[..., None]):
        self.add = add
        self.handles: list[Any] = []
        self.open: tuple[int, str] | None = None  # (id of the module being timed, "forward" | "backward")
        self.t0 = 0.0

    def install(self, modules: list[nn.Module]) -> None:
        seen: set[int] = set()
        for root in modules:
            for name, module in root.named_modules():
                kind = kind_of(name, module)
                if kind is None or id(module) in seen:
                    continue
                seen.add(id(module))
                self._hook(module, kind)

    def _hook(self, module: nn.Module, kind: str) -> None:
        key = id(module)
        self.handles += [
            module.register_forward_pre_hook(lambda m, args: self._begin(key, "forward")),
            module.register_forward_hook(lambda m, args, out: self._end(key, "forward", kind)),
            module.register_full_backward_pre_hook(lambda m, grad_out: self._begin(key, "backward")),
            module.register_full_backward_hook(lambda m, grad_in, grad_out: self._end(key, "backward", kind)),
        ]

    def _begin(self, key: int, phase: str) -> None:
        if self.open is None:
            self.open, self.t0 = (key, phase), time.time()

    def _end(self, key: int, phase: str, kind: str) -> None:
        if self.open == (key, phase):
            self.add("module", kind, self.t0, time.time(), phase=phase)
            self.open = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.open = [], None
