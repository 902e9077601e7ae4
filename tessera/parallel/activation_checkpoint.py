"""Activation recomputation: trade compute for memory by re-running forward pieces in backward.

- "full": every `interval`-th block (layer id % interval == 0) keeps only its input; its whole
  forward runs again during backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
  Cost").
- "selective": the attention core of every block is recomputed while the outputs of matrix
  multiplications and collectives are kept (Korthikanti et al. 2022, section 5: the softmax /
  attention-score activations are large and cheap to recompute). Implemented with PyTorch's
  selective checkpoint policy on each attention module.

Recomputation never changes numerics: forward ops rerun on the same inputs give bit-identical
results (RNG state is restored). The module's forward is wrapped in place, so parameter names do
not change (no wrapper module is inserted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tessera.config.errors import ParallelError
from tessera.config.parallel import RECOMPUTE_CHOICES

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _MATMULS.add(torch.ops.aten._grouped_mm.default)
_MATMULS.add(torch.ops.aten._scaled_mm.default)  # FP8 linear layers (tessera.models.float8)


def keep_matmuls_and_collectives(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: save matrix-multiply and communication outputs, recompute the rest."""
    if op in _MATMULS or getattr(op, "namespace", "") == "_c10d_functional":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(keep_matmuls_and_collectives)


def checkpoint_module(module: nn.Module, context_fn: Callable | None = None, mode: str = "full") -> None:
    """Make `module(...)` recompute its forward in backward (non-reentrant checkpoint)."""
    inner = module.forward
    kwargs = {} if context_fn is None else {"context_fn": context_fn}

    def recomputed_forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = recomputed_forward
    module.recompute = mode  # visible to tests and to whoever prints the model


def apply_activation_checkpointing(model: nn.Module, mode: str, interval: int = 1) -> list[str]:
    """Wrap the model's blocks; returns the names of the modules that now recompute."""
    if mode not in RECOMPUTE_CHOICES:
        raise ParallelError(f"recompute={mode!r} is invalid: one of {', '.join(RECOMPUTE_CHOICES)}")
    if interval < 1:
        raise ParallelError(f"recompute_interval={interval} is invalid: must be >= 1")
    wrapped: list[str] = []
    if mode == "none":
        return wrapped
    for key, block in model.layers.items():
        if mode == "full":
            if int(key) % interval == 0:
                checkpoint_module(block, mode="full")
                wrapped.append(f"layers.{key}")
        else:
            checkpoint_module(block.attention, _selective_context, mode="selective")
            wrapped.append(f"layers.{key}.attention")
    return wrapped
