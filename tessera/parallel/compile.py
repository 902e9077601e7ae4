"""`train.compile`: each transformer block compiled with torch.compile, as torchtitan does.

One compiled region per block (not one for the whole model): every block has the same code and
shapes, so the first block's graph is reused by the others, compile time stays that of one block,
and the per-block seams the other parallelisms use stay where they are. The step runs in
`parallelize`'s fixed order after expert and context parallelism and activation checkpointing,
and before FSDP (docs/architecture.md, "Parallelize and its seams"), and in the one-process trainer
on the plain model.

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
and the experts run as one grouped GEMM (rows a multiple of 16 bytes), without Sinkhorn routing
(whose iterations stop on a tolerance read on the host). Elsewhere (fp32 or fp16, expert/tensor/
context parallelism, `moe.grouped_gemm=false`, Sinkhorn) only its attention half is compiled
and the routing, dispatch and expert GEMMs run eagerly between compiled regions.

Tensor parallelism is not compiled yet: with DTensor-sharded projections inside a compiled block,
backward hands a plain tensor to DTensor's redistribution (`AttributeError: 'Tensor' object has
no attribute '_local_tensor'` in torch 2.13 on CPU/gloo, with or without sequence parallelism).
So `train.compile` defaults to off under parallel.tp > 1 and `train.compile=true` is refused there;
likewise with `parallel.optimizer=distributed` on several ranks, whose forward pre-hooks (waiting for
the updated weights' all-gathers) are not compiled into the blocks; and with `parallel.recompute=op`,
whose checkpoint runs a policy of its own dispatch modes that dynamo does not trace ("checkpoint not
implemented for ... context_fn" in torch 2.13). The full and selective policies compile.
FSDP2, expert and context parallelism, pipeline stages and activation checkpointing compose with
it (tests/parallel/test_compile.py). The collectives a block calls (context parallelism's
all-to-all and all-gather, tessera.parallel.collectives) run eagerly between its compiled graphs:
traced by torch 2.11, their backward lost its result.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from tessera.config.errors import ConfigError

__all__ = ["compile_blocks", "resolve_compile"]


def _conflict(tp: int, distributed_optimizer: bool, recompute: str = "none") -> tuple[str, str] | None:
    """What in the layout keeps blocks from being compiled, naming its key, and the other way out
    than train.compile=false; None when nothing does."""
    if recompute == "op":
        return ("parallel.recompute=op: its operator-level policy decides per operator at run time "
                "(tessera.parallel.memory.recompute_policy), which torch.compile cannot trace inside a checkpoint",
                "parallel.recompute=selective or full")
    if tp > 1:
        return (f"parallel.tp={tp}: compiled blocks do not yet compose with tensor parallelism (DTensor "
                "gradients at the compiled boundary)", "parallel.tp=1")
    if distributed_optimizer:
        return ("parallel.optimizer=distributed: its forward pre-hooks, which wait for their buckets' "
                "all-gathers, are not compiled into the blocks", "parallel.optimizer=fsdp")
    return None


def resolve_compile(setting: bool | None, device: torch.device, tp: int = 1,
                    distributed_optimizer: bool = False, recompute: str = "none") -> bool:
    """`train.compile` as run on `device` with `tp`-way tensor parallelism and, on several ranks,
    `parallel.optimizer=distributed`, and the `recompute` policy: None means on for CUDA where the
    layout allows it, off otherwise (where that turns the CUDA default off, rank 0 says why in one
    line on stderr); true where the layout does not allow it is refused (see above)."""
    conflict = _conflict(tp, distributed_optimizer, recompute)
    if setting and conflict:
        raise ConfigError(f"train.compile=true is invalid with {conflict[0]}; set train.compile=false or "
                          f"{conflict[1]}")
    if setting is not None:
        return bool(setting)
    if device.type == "cuda" and conflict and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"train.compile unset: blocks run eagerly on {device}, not compiled as by default on CUDA, "
              f"because of {conflict[0]}", file=sys.stderr, flush=True)
    return device.type == "cuda" and conflict is None


def _compile_forward(module: nn.Module) -> None:
    module.forward = torch.compile(module.forward)
    module.compiled = True  # visible to tests and to whoever prints the model


def moe_compiles_whole(block: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether the MoE layer of `block`, computing in `dtype`, traces as one graph (see above)."""
    from tessera.models.moe.capacity import local_keep_mask
    from tessera.models.moe.dispatcher import LocalDispatcher
    from tessera.models.moe.router import no_reduction

    moe = block.moe
    if dtype != torch.bfloat16 or not isinstance(moe.dispatcher, LocalDispatcher) or not moe.cfg.grouped_gemm:
        return False
    if moe.router.reduce_counts is not no_reduction or moe.keep_mask is not local_keep_mask:
        return False  # context parallelism: routing counts summed over ranks (collectives, a host read)
    if moe.cfg.sinkhorn:
        return False  # Sinkhorn's iterations stop on a tolerance read on the host
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
