"""`train.compile`: each transformer block compiled with torch.compile, as torchtitan does.

One compiled region per block (not one for the whole model): every block has the same code and
shapes, so the first block's graph is reused by the others, compile time stays that of one block,
and the per-block seams the other parallelisms use stay where they are. The step runs in
`parallelize`'s fixed order after expert and context parallelism and activation checkpointing,
and before FSDP (DESIGN.md), and in the one-process trainer on the plain model.

What is compiled is the block's `forward` (like activation checkpointing, which replaces the same
attribute): module hooks stay outside the compiled region, so FSDP2's all-gather / reduce-scatter
hooks registered on the block afterwards run eagerly around it, and a checkpointed forward is
compiled with its recomputation. Parameter names do not change (no `_orig_mod.` wrapper), so
checkpoints and HF adapters see the same model.

A dense block traces as one graph (tests/parallel/test_compile.py checks it with `fullgraph=True`);
it is compiled without `fullgraph`, so that a break some other model family may add costs speed,
not the run. An MoE block is compiled whole where its MoE layer traces as one graph: the blocks
compute in bf16 (the fake-tensor rule of `torch._grouped_mm` accepts only bf16 inputs, although
the eager CPU kernel takes fp32), the tokens stay on this rank (the local dispatcher has fixed
shapes: no `bincount`, no host reads; the expert-parallel dispatchers read split sizes on the host)
and the experts run as one grouped GEMM (rows a multiple of 16 bytes). Elsewhere (fp32 or fp16,
expert/tensor/context parallelism, `moe.grouped_gemm=false`) only its attention half is compiled
and the routing, dispatch and expert GEMMs run eagerly between compiled regions.

Tensor parallelism is not compiled yet: with DTensor-sharded projections inside a compiled block,
backward hands a plain tensor to DTensor's redistribution (`AttributeError: 'Tensor' object has
no attribute '_local_tensor'` in torch 2.13 on CPU/gloo, with or without sequence parallelism).
So `train.compile` defaults to off under parallel.tp > 1 and `train.compile=true` is refused there.
FSDP2, expert and context parallelism, pipeline stages and activation checkpointing compose with
it (tests/parallel/test_compile.py). The collectives a block calls (context parallelism's
all-to-all and all-gather, tessera.parallel.collectives) run eagerly between its compiled graphs:
traced by torch 2.11, their backward lost its result.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config.errors import ConfigError

__all__ = ["compile_blocks", "resolve_compile"]


def resolve_compile(setting: bool | None, device: torch.device, tp: int = 1) -> bool:
    """`train.compile` as run on `device` with `tp`-way tensor parallelism: None means on for CUDA
    without tensor parallelism, off otherwise; true under tp > 1 is refused (see above)."""
    if setting and tp > 1:
        raise ConfigError(f"train.compile=true is invalid with parallel.tp={tp}: compiled blocks do not yet "
                          "compose with tensor parallelism (DTensor gradients at the compiled boundary); "
                          "set train.compile=false or parallel.tp=1")
    return device.type == "cuda" and tp == 1 if setting is None else bool(setting)


def _compile_forward(module: nn.Module) -> None:
    module.forward = torch.compile(module.forward)
    module.compiled = True  # visible to tests and to whoever prints the model


def moe_compiles_whole(block: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether the MoE layer of `block`, computing in `dtype`, traces as one graph (see above)."""
    from tessera.models.moe.dispatcher import LocalDispatcher

    moe = block.moe
    if dtype != torch.bfloat16 or not isinstance(moe.dispatcher, LocalDispatcher) or not moe.cfg.grouped_gemm:
        return False
    _, ffn_dim, dim = moe.experts.w1.shape  # [E, F, D]: bf16 rows of F and D elements, 16-byte aligned
    return dim % 8 == 0 and ffn_dim % 8 == 0


def compile_blocks(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Compile every transformer block of `model` (a whole model or a pipeline stage) in place,
    the blocks computing in `dtype` (the autocast or FSDP compute dtype; None: fp32); returns the
    names of the compiled modules."""
    compiled: list[str] = []
    for key, block in model.layers.items():
        if hasattr(block, "moe") and not moe_compiles_whole(block, dtype):
            _compile_forward(block.attention)
            compiled.append(f"layers.{key}.attention")
        else:
            _compile_forward(block)
            compiled.append(f"layers.{key}")
    return compiled
