"""A decode step's dense layer of GGUF blocks in one C++ call, and the logits' checks in one pass, on CPU.

With the block kernels (gguf_matmul.py) and the one-pass layer kernels (layer_ops.py) installed, a decode
step of SmolLM2-135M's Q4_1 file still spends about half its CPU time outside the block products: per
layer about a dozen module calls, their checks and views, the cache write's eight PyTorch ops and the
attention's dispatch (docs/benchmarks/2026-11-30-gguf-decode-profile.md). `csrc/gguf_layer_cpu.cpp`
(`torch.ops.tessera_cpu.gguf_dense_layer`) runs the whole layer in one call: RMSNorm, the grouped q/k/v
product, RoPE, the paged cache write (fp32, or int8 with its scales), paged attention over each row's
blocks, the o product and residual, RMSNorm, the grouped gate/up product, SiLU * up, the down product and
residual, with the kernels the modules call, in their order: the same bits as the modules.

`fuse_gguf_layers(model)` installs a `GgufDenseLayer` at every `TransformerBlock.fused_layer` (the seam)
that it computes: a dense llama-style block (pre-norms without Gemma's offset, no post-norms, softmax
attention with whole-head RoPE, no QK norm, output gate, sinks or NoPE, SwiGLU) whose seven projections are
kernel-backed GGUF block matrices (`block_product`, grouped `BlockGroup`s at `fused_qkv` and
`fused_gate_up`), its norms, RoPE and activation on the layer kernels. At each call it answers None, and
the modules run, where it does not apply now: autograd, more than `MAX_ROWS` rows, a hook on a projection
(a dynamic LoRA adapter), a layer's kernel taken off, a cache that is not read in place by the C++
attention kernel for this layer (`ragged_plan` of the step's cache: paged_attention.py, bucketed_decode.py;
float64 attention, chunked windows, a windowed pool), or Llama 4's query scale.

Where every layer of a `Transformer` took one, `fuse_gguf_layers` also installs a `GgufDenseStack` at its
`fused_stack` seam: the step's layers in one `gguf_dense_stack` call (each layer's `gguf_dense_layer` in turn,
in C++: the same bits), which saves the Python between the layers (the block's module call, the RoPE tables'
lookups, the checks and arguments of 30 op calls). It answers None, and the layer loop runs with each
block's own `fused_layer`, wherever one of them would answer None (GgufDenseStack's docstring names the
cases it adds). The engine installs both for a model it owns on CPU in fp32, never under tensor parallelism
(the o and down products there are partial sums reduced across ranks). `TESSERA_CPU_ATTENTION=torch` turns
them off with the library's other kernels.

`logit_checks(logits, rows)`: whether each read row is finite and its argmax, one pass per row (PyTorch's
`isfinite(...).all()` is five ops over the rows, each its own parallel region), used by the model runner.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS, BlockGroup, block_product

_PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                "feed_forward.w3", "feed_forward.w2")


class GgufDenseLayer:
    """One `TransformerBlock`'s layer as one `gguf_dense_layer` call (module docstring); called as the
    block's `fused_layer` with (x [1, T, D], cos, sin, cache), the block's output, or None where the
    modules must run."""

    def __init__(self, block: nn.Module):
        self.block = block
        attention, ffn = block.attention, block.feed_forward
        self.layers = [block.get_submodule(name) for name in _PROJECTIONS]
        self.eps = block.attention_norm.eps
        self.sizes = [m.out_features for m in self.layers]
        self.kinds = (attention.wq.kind, attention.wo.kind, ffn.w1.kind, ffn.w2.kind)
        biases = [m.bias for m in self.layers[:3]]
        self.qkv_bias = (None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)]))
        self.head_dim, self.scale = attention.head_dim, attention.scale
        self.layer_id, self.window = attention.layer_id, attention.window
        self.norms = (block.attention_norm, block.ffn_norm)
        self.attention, self.ffn = attention, ffn
        self.hooked = (*self.layers, attention, ffn, *self.norms)  # modules whose hooks must see their calls

    def _installed(self) -> bool:
        """Whether every module still runs the kernel this call stands for (none taken off, no hook on
        one: it must see its own call). Plain loops over attributes read once: this runs every layer of
        every step."""
        for m in self.layers:
            if m.fused is not block_product:
                return False
        for m in self.hooked:
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        return (self.norms[0].fused is not None and self.norms[1].fused is not None
                and self.attention.fused_rope is not None and self.ffn.fused_act is not None)

    def fits(self, x_BSD: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether this call's rows and tables are the kernel's (no autograd, fp32 CPU rows [1, T <= MAX_ROWS,
        D], whole-head RoPE) and every module still runs the kernel it stands for."""
        return not (torch.is_grad_enabled() or x_BSD.dtype != torch.float32 or x_BSD.device.type != "cpu"
                    or x_BSD.shape[0] != 1 or x_BSD.shape[1] > MAX_ROWS or cos.shape[-1] != self.head_dim
                    or not self._installed())

    def attention_state(self, cache, x_BSD: torch.Tensor) -> tuple[torch.Tensor, object, list[torch.Tensor]] | None:
        """(the step's slots, its contexts, this layer's cache tensors) where the C++ kernel reads this layer's
        cache in place (`ragged_plan`), else None."""
        plan = getattr(cache, "ragged_plan", None)
        plan = plan(self.layer_id, self.window) if plan is not None else None
        if plan is None:
            return None
        kv = cache.kv
        store = [kv.k[self.layer_id], kv.v[self.layer_id]]
        if kv.int8:
            store += [kv.k_scale[self.layer_id], kv.v_scale[self.layer_id]]
        elif store[0].dtype != torch.float32:
            return None
        if not cpu_attention.usable(store[0], x_BSD):  # (TESSERA_CPU_ATTENTION=torch set since)
            return None
        return plan[0], plan[1], store

    def __call__(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor | None:
        state = self.attention_state(cache, x_BSD) if self.fits(x_BSD, cos) else None
        if state is None:
            return None
        slots, contexts, store = state
        norms = [n.weight for n in self.norms]  # read now: sleep may swap them
        y = torch.ops.tessera_cpu.gguf_dense_layer(
            x_BSD[0].contiguous(), norms, self.eps, [m.blocks for m in self.layers], *self.kinds, self.sizes,
            self.qkv_bias, cos, sin, self.head_dim, store, slots, contexts.rows_R4, contexts.block_index,
            contexts.block_size, self.scale, self.window or 0)
        return y[None]


class GgufDenseStack:
    """A model's dense GGUF layers as one `gguf_dense_stack` call per step; called as the `Transformer`'s
    `fused_stack` with (h [1, T, D], the step's RoPE tables, cache), the last layer's output, or None where
    the layer loop must run (then each block's `fused_layer` decides for its own layer, as without the stack).

    It answers None wherever one of the layers' `GgufDenseLayer` would (each layer's own `fits` and
    `attention_state`), and besides: a block's `fused_layer` no longer the one it was built with, a hook on a
    block, layers whose cache plans differ (slots or contexts), RoPE tables of their own for window layers, or
    a query scale (Llama 4's)."""

    def __init__(self, layers: list[GgufDenseLayer]):
        self.layers = layers
        self.blocks = [layer.block for layer in layers]
        self.eps = [layer.eps for layer in layers]
        self.kinds = [kind for layer in layers for kind in layer.kinds]
        self.sizes = [n for layer in layers for n in layer.sizes]
        self.qkv_bias = [layer.qkv_bias for layer in layers]
        self.scales = [float(layer.scale) for layer in layers]
        self.windows = [layer.window or 0 for layer in layers]
        self.head_dim = layers[0].head_dim

    def __call__(self, x_BSD: torch.Tensor, rope, cache) -> torch.Tensor | None:
        if rope.local is not None or rope.q_scale is not None:
            return None
        cos, sin = rope.cos, rope.sin
        plan, stores, norms, mats = None, [], [], []
        for block, layer in zip(self.blocks, self.layers):
            if (block.fused_layer is not layer or block._forward_hooks or block._forward_pre_hooks
                    or not layer.fits(x_BSD, cos)):
                return None
            state = layer.attention_state(cache, x_BSD)
            if state is None or (plan is not None and (state[0] is not plan[0] or state[1] is not plan[1])):
                return None
            plan = state
            stores += state[2]
            norms += [n.weight for n in layer.norms]  # read now: sleep may swap them
            mats += [m.blocks for m in layer.layers]
        slots, contexts, _ = plan
        y = torch.ops.tessera_cpu.gguf_dense_stack(
            x_BSD[0].contiguous(), norms, self.eps, mats, self.kinds, self.sizes, self.qkv_bias, cos, sin,
            self.head_dim, stores, slots, contexts.rows_R4, contexts.block_index, contexts.block_size, self.scales,
            self.windows)
        return y[None]


def _dense_gguf_block(block: nn.Module) -> bool:
    """Whether `block` is a dense llama-style block whose layer `gguf_dense_layer` computes (module
    docstring), its projections on the block kernels and its norms, RoPE and activation on the layer ops."""
    from tessera.models.attention import Attention
    from tessera.models.mlp import FeedForward

    a, f = block.attention, getattr(block, "feed_forward", None)
    if type(a) is not Attention or type(f) is not FeedForward or f.activation != "silu":
        return False
    if (block.attention_norm is None or block.ffn_norm is None or block.attention_post_norm is not None
            or block.ffn_post_norm is not None or block.attention_norm.unit_offset or block.ffn_norm.unit_offset):
        return False
    if (a.q_norm is not None or a.output_gate or a.sinks is not None or not a.rotary or a.interleaved
            or a.qk_l2_norm or a.wo.bias is not None):
        return False
    if not (isinstance(a.fused_qkv, BlockGroup) and isinstance(f.fused_gate_up, BlockGroup)):
        return False
    layers = [block.get_submodule(name) for name in _PROJECTIONS]
    kinds_match = a.wq.kind == a.wk.kind == a.wv.kind and f.w1.kind == f.w3.kind
    return kinds_match and all(getattr(m, "fused", None) is block_product for m in layers)


def fuse_gguf_layers(model: nn.Module) -> int:
    """Install a `GgufDenseLayer` at every block of `model` it computes (after the layer ops and the
    block kernels are installed), and a `GgufDenseStack` at each `Transformer` whose every layer took one
    (one head size); returns how many blocks took one (0 where the library is not available)."""
    from tessera.models.transformer import Transformer, TransformerBlock

    if not cpu_attention.library_available():
        return 0
    n = 0
    for block in model.modules():
        if isinstance(block, TransformerBlock) and _dense_gguf_block(block):
            block.fused_layer = GgufDenseLayer(block)
            n += 1
    for m in model.modules():
        if isinstance(m, Transformer) and len(m.layers):
            layers = [getattr(block, "fused_layer", None) for block in m.layers.values()]
            if (all(isinstance(layer, GgufDenseLayer) for layer in layers)
                    and len({layer.head_dim for layer in layers}) == 1):
                m.fused_stack = GgufDenseStack(layers)
    return n


def unfuse_gguf_layers(model: nn.Module) -> None:
    """Every block back to its modules, every stack off (benchmarks alternate the two)."""
    from tessera.models.transformer import Transformer, TransformerBlock

    for m in model.modules():
        if isinstance(m, TransformerBlock):
            m.fused_layer = None
        elif isinstance(m, Transformer):
            m.fused_stack = None


def logit_checks(logits_TV: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(finite [R] int64: 1 where logits row rows[r] is all finite, argmax [R] int64) in one pass per row,
    or None where the kernel does not serve (logits not fp32 on CPU, the library off): the caller then
    uses PyTorch's ops."""
    if (logits_TV.device.type != "cpu" or logits_TV.dtype != torch.float32 or logits_TV.dim() != 2
            or logits_TV.stride(-1) != 1 or not cpu_attention.library_available()):
        return None
    out = torch.ops.tessera_cpu.logit_checks(logits_TV, rows)
    return out[0], out[1]
