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

import torch
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
    `add(kind, name, t0, t1, **fields)` is the recorder's. With `cuda`, a module's time is that of
    its kernels (CUDA events around it on the current stream), not of their launch."""

    def __init__(self, add: Callable[..., None], cuda: bool = False):
        self.add = add
        self.cuda = cuda
        self.event: Any = None  # the open interval's start event (cuda)
        self.pending: list[tuple[str, str, float, Any, Any]] = []  # (kind, phase, t0, start, end) events
        self.handles: list[Any] = []
        self.open: tuple[int, str] | None = None  # (id of the module being timed, "forward" | "backward")
        self.t0 = 0.0
        self.waiting: list[int] = []  # backwards begun while another was open, not yet ended

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
            module.register_forward_hook(lambda m, args, kwargs, out: self._forward_end(key, kind, args, kwargs, out),
                                         with_kwargs=True),
        ]

    def _forward_end(self, key: int, kind: str, args: tuple, kwargs: dict, out: Any) -> None:
        """The forward's interval; and its backward's, from the gradient of its output (the first to
        arrive) to that of its input (the first): hooks on those tensors, not the module's full
        backward hooks, which would hand back views of the outputs (that FSDP2 and in-place ops refuse)."""
        self._end(key, "forward", kind)
        if not torch.is_grad_enabled():
            return
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        outputs = [t for t in (out if isinstance(out, tuple | list) else (out,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs or not outputs:  # no gradient reaches an input: the backward would never close
            return
        for t in outputs:
            t.register_hook(lambda grad: self._begin(key, "backward"))
        for t in inputs:
            t.register_hook(lambda grad: self._end(key, "backward", kind))

    def _open(self, key: int, phase: str, now: float) -> None:
        self.open, self.t0 = (key, phase), now
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def _begin(self, key: int, phase: str) -> None:
        if self.open is None:
            self._open(key, phase, time.time())
        elif phase == "backward":  # one module's output is the next one's input: its begin may come first
            self.waiting.append(key)

    def _end(self, key: int, phase: str, kind: str) -> None:
        if self.open == (key, phase):
            now = time.time()
            if self.cuda:  # the kernels' time, read when the step ends (`remove`)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pending.append((kind, phase, self.t0, self.event, end))
            else:
                self.add("module", kind, self.t0, now, phase=phase)
            self.open = None
            if self.waiting:  # a backward that began at the gradient that closed this one
                self._open(self.waiting.pop(), "backward", now)
                self.waiting.clear()
        elif phase == "backward" and key in self.waiting:  # nested inside the open one: counted there
            self.waiting.remove(key)

    def remove(self) -> None:
        """The hooks removed; on a GPU the step's intervals written, each from where the host began it
        for as long as its kernels ran between its two events."""
        for handle in self.handles:
            handle.remove()
        if self.pending:
            torch.cuda.synchronize()
        for kind, phase, t0, begin, end in self.pending:
            self.add("module", kind, t0, t0 + begin.elapsed_time(end) / 1e3, phase=phase)
        self.handles, self.open, self.waiting, self.pending = [], None, [], []
