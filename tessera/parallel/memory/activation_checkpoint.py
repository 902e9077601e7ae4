"""Activation recomputation: trade compute for memory by re-running forward pieces in backward.

The policies (`parallel.recompute`, one of RECOMPUTE_CHOICES; `parallel.recompute_interval` k
applies any of them to the blocks whose layer id is a multiple of k, the others keep everything):

- "full": the block keeps only its input; its whole forward runs again during backward (Chen et
  al. 2016, "Training Deep Nets with Sublinear Memory Cost").
- "selective": Megatron's selective recomputation (Korthikanti et al. 2022, arXiv 2205.05198,
  section 5): the attention core re-runs in backward from its inputs q, k, v, which stay saved;
  the matrix products' outputs and everything else stay saved. Implemented by checkpointing the
  attention core seam (whatever core is installed: SDPA, or context parallelism's).
- "op": torchtitan's operator-level policy: the block re-runs except the operators named by
  `parallel.recompute_save`, whose outputs are kept (recompute_policy.py), optionally in FP8
  (`parallel.activation_fp8`).

`parallel.activation_offload` moves what the blocks save to host memory (activation_offload.py,
applied after compilation: its hooks wrap the compiled block).

Recomputation never changes numerics: forward operators re-run on the same inputs give bit-identical
results (RNG state is restored). Only FP8 storage changes them (the replay starts from the rounded
outputs). The module's forward (or the core seam) is wrapped in place, so parameter names do not
change (no wrapper module is inserted).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.config.errors import ParallelError
from tessera.config.parallel import RECOMPUTE_CHOICES, TORCHTITAN_SAVE
from tessera.models.attention import Attention
from tessera.models.mla import MultiHeadLatentAttention
from tessera.parallel.memory.recompute_policy import BlockOpPolicy


def checkpoint_module(module: nn.Module, context_fn: Callable | None = None, mode: str = "full") -> None:
    """Make `module(...)` recompute its forward in backward (non-reentrant checkpoint)."""
    inner = module.forward
    kwargs = {} if context_fn is None else {"context_fn": context_fn}

    def recomputed_forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs, **kw)

    module.forward = recomputed_forward
    module.recompute = mode  # visible to tests and to whoever prints the model


class RecomputedCore:
    """An attention core seam whose call is checkpointed: q, k, v stay saved, the kernel re-runs."""

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def recomputed_layers(n_layers: int, interval: int) -> list[int]:
    """The layer ids the policy applies to (the planner counts the same ones)."""
    return [i for i in range(n_layers) if i % interval == 0]


def apply_activation_checkpointing(model: nn.Module, mode: str, interval: int = 1, *,
                                   save: tuple[str, ...] = TORCHTITAN_SAVE, fp8: tuple[str, ...] = ()
                                   ) -> list[str]:
    """Apply policy `mode` to every `interval`-th block of `model` (a whole model or a pipeline
    stage); returns the names of the modules that now recompute. `save` and `fp8`: what
    `mode="op"` keeps, and keeps in FP8."""
    if mode not in RECOMPUTE_CHOICES:
        raise ParallelError(f"recompute={mode!r} is invalid: one of {', '.join(RECOMPUTE_CHOICES)}")
    if not isinstance(interval, int) or interval < 1:
        raise ParallelError(f"recompute_interval={interval} is invalid: must be >= 1")
    if fp8 and mode != "op":
        raise ParallelError(f"activation_fp8={list(fp8)} needs recompute=op (now {mode})")
    wrapped: list[str] = []
    if mode == "none":
        return wrapped
    for key, block in model.layers.items():
        if int(key) % interval:
            continue
        if mode == "full":
            checkpoint_module(block, mode="full")
            wrapped.append(f"layers.{key}")
        elif mode == "op":
            policy = BlockOpPolicy(save, fp8)
            policy.install(block)
            checkpoint_module(block, policy.context, mode="op")
            block.recompute_policy = policy  # visible to tests and to the planner's measurements
            wrapped.append(f"layers.{key}")
        else:
            for name, module in block.named_modules():
                if isinstance(module, (Attention, MultiHeadLatentAttention)):
                    module.attention_core = RecomputedCore(module.attention_core)
                    module.recompute = "selective"
                    wrapped.append(f"layers.{key}.{name}.attention_core")
    return wrapped
