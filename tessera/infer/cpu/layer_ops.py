"""The elementwise work of a served fp32 model on CPU, one kernel call each instead of a chain of ops.

RMSNorm (x.float(), pow, mean, add, rsqrt, two products, casts), the rotary embedding of q and k
(per tensor: two unsqueezes, chunk, negation, cat, two products, a sum) and SwiGLU's activation
(silu, then a product) are each five to ten PyTorch ops, every one a dispatch and a pass over its
rows. In a decode step of a few rows the rows are short and the dispatches are what costs: about
two thousand op calls per step for a 12-layer model. `csrc/layer_ops_cpu.cpp` does each in one pass
over the rows, in the same library as the paged-attention kernel (infer/cpu/attention.py builds both).
The chunked delta rule of Gated DeltaNet and Kimi delta attention (a prompt's or prompt chunk's
recurrent layers) computes each chunk's own terms with a dozen such ops (L2 norms, re-layouts, the
decays' cumulative sums and exps, scalings) and five batched products of small matrices;
`csrc/delta_rule_cpu.cpp` computes them a chunk at a time in cache (`delta_chunk_terms`, at the
mixers' `fused_chunk_terms`), leaving the products with the state to the chunk loop.

`fuse_layer_ops(model)` installs them at the models' seams (`RMSNorm.fused`, `Attention.fused_rope`,
`FeedForward.fused_act`, the delta-rule mixers' `fused_chunk_terms`, and `FeedForward.fused_swiglu`
where the gate and up product runs on the panel kernel: the activation in that product's epilogue,
infer/cpu/linear.py), which use them only
without autograd (a served model), so the same modules still train. The engine calls it for a
model it owns, on CPU in fp32 with its projections packed (infer/cpu/linear.py), when the library builds;
`TESSERA_CPU_ATTENTION=torch` turns the kernels off as it does the attention kernel's. The values
are those of the PyTorch ops up to the order of fp32 sums (tests/infer/test_cpu_layer_ops.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.infer.cpu import attention as cpu_attention


@torch.no_grad()
def fuse_layer_ops(model: nn.Module) -> int:
    """Install the one-pass kernels at every seam of `model` they compute (SwiGLU, an RMSNorm without
    Gemma's offset, RoPE over the whole head), a model computing in fp32 on CPU (its
    projections may hold int8 weights; a module with floating-point weights of another dtype or
    device is left alone); returns how many seams took one (0 where the library is not available)."""
    from tessera.infer.cpu.linear import FusedLinear
    from tessera.models.attention import Attention
    from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
    from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
    from tessera.models.mlp import FeedForward
    from tessera.models.norm import RMSNorm

    if not cpu_attention.library_available():
        return 0
    ops = torch.ops.tessera_cpu
    n = 0
    for module in model.modules():
        if isinstance(module, (GatedDeltaNet, KimiDeltaAttention)) and module.dt_bias.device.type == "cpu":
            module.fused_chunk_terms = ops.delta_chunk_terms  # (any dtype: its slabs are read in fp32)
        elif isinstance(module, RMSNorm) and not module.unit_offset and _fp32_cpu(module.weight):
            module.fused = ops.rms_norm
        elif type(module) is Attention and _fp32_cpu(getattr(module.wq, "weight", None)):
            # (a partial or interleaved rotary steps aside from it in Attention.forward)
            module.fused_rope = ops.rope_
        elif (isinstance(module, FeedForward) and module.activation == "silu"
              and _fp32_cpu(getattr(module.w1, "weight", None))):
            module.fused_act = ops.silu_mul
            fused = module.fused_gate_up
            if isinstance(fused, FusedLinear) and fused.has_swiglu:  # the activation in the product's epilogue
                module.fused_swiglu = fused.swiglu
        else:
            continue
        n += 1
    return n


def unfuse_layer_ops(model: nn.Module) -> None:
    """Take the kernels out again: every seam back to the PyTorch ops (benchmarks alternate the two)."""
    from tessera.models.attention import Attention
    from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
    from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
    from tessera.models.mlp import FeedForward
    from tessera.models.norm import RMSNorm

    for module in model.modules():
        if isinstance(module, (GatedDeltaNet, KimiDeltaAttention)):
            module.fused_chunk_terms = None
        elif isinstance(module, RMSNorm):
            module.fused = None
        elif isinstance(module, Attention):
            module.fused_rope = None
        elif isinstance(module, FeedForward):
            module.fused_act = None
            module.fused_swiglu = None


def _fp32_cpu(weight: torch.Tensor | None) -> bool:
    """A weight on CPU, fp32 or integer (quantized, computing in fp32); None: a module holding its
    weight elsewhere (quantized types), taken to compute as the model does."""
    return weight is None or (weight.device.type == "cpu"
                              and (weight.dtype == torch.float32 or not weight.is_floating_point()))
