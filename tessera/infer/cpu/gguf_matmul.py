"""Products by GGUF block matrices on CPU without dequantizing them: the kernel `GgufLinear` uses.

`tessera.models.gguf_linear.GgufLinear` keeps a GGUF file's block matrix as its bytes; by itself it
multiplies by dequantizing the whole matrix in every forward (the reference). `csrc/gguf_matmul_cpu.cpp`
(`torch.ops.tessera_cpu.gguf_linear`, in the library infer/cpu/attention.py builds) multiplies by
the blocks as they lie, in the manner of llama.cpp's CPU kernels: the activations are quantized per
row and per 32 inputs (a scale per 32, and their sum for the types with an offset), each 32 weights
are unpacked to small integers in registers and multiplied by them in integers (AVX2 `madd`, chosen
at run time; portable loops elsewhere), the blocks' scales and offsets applied once per 32 in fp32.
A decode step reads each weight row once at the format's bytes per weight (Q4_1: 0.625 bytes,
against 4 for the dequantized fp32 model).

The activations are rounded to int16, not to llama.cpp's int8: with int8 the perplexity of SmolLM2's
Q4_1 file on a held-out text rose by 1.4% over the dequantized model (one large input in a group of
32 leaves the others a few levels), with int16 it is the dequantized model's to 0.003% (the C++
file's comment; tests/infer/test_gguf_matmul_smollm2.py). Types: `KINDS` (Q2_K and Q3_K keep the
reference). The result differs from the product by the dequantized weight by that rounding only:
per 32 inputs with maximum |x| = a, each input moves by at most a / 65534, so |y - y_ref| <= sum over
the 32-groups of a / 65534 * sum |w| (plus fp32 rounding); tests/infer/test_gguf_matmul.py checks
that bound, and the kernel against the product by the dequantized weight and the rounded activations
to fp32 rounding. Every output is computed by one thread in one order (the C++ file's comment), so
the result is the same bits for any thread count, with the AVX2 path or the portable one
(`portable=True`, which tests use), and whatever other rows share the product. The K-quants (Q4_K,
Q5_K, Q6_K) take a loop of their own, a super-block at a time and up to 8 rows of x a pass, with an order
of sums of their own (the same in its portable twin; the C++ file's comment): Q4_K by one row of x
1.6-2.1x faster than the sub-block loop (docs/benchmarks.md). On a CPU with AVX-512 F, BW, VL and VNNI
(chosen at run time, `block_isa`), one row of x on the sub-block types and the wide head take AVX-512 loops
(csrc/block_dot_avx512.h: two sub-blocks' or two rows' 64 weights a zmm register, the four-input sums by
permutations, madd and VNNI's dpwssd), the same bits: 0.75-0.76x the CPU time of the 30 layer ops of a
SmolLM2 decode step, 0.53-0.77x that of its head, 0.67-0.68x the whole batch-1 step (docs/benchmarks.md);
more rows and the K-quants keep the AVX2 loops.

`use_block_kernels(model)` installs it at every `GgufLinear.fused` of a model the engine owns on
CPU in fp32 (LLMEngine, beside the panel and layer kernels), and at each projection of the routed
experts kept as blocks (`ExpertBlocks.fused`, tessera/models/moe/gguf_experts.py: one expert's
blocks times the rows routed to it); it computes fp32 activations without autograd, up to
`MAX_ROWS` rows (a decode step, a short prompt chunk; an expert's share of one). Longer prompt chunks take the
reference's arithmetic, the matrix dequantized once for all their rows (which then costs less than
the integer products per row), dequantized by the same library (`gguf_dequantize`: gguf_blocks'
values bit for bit, about 1.5x as fast as its PyTorch ops). `TESSERA_CPU_ATTENTION=torch` turns it off
with the library's other kernels.

At the model's output head (`model.output`: SmolLM2's is its Q8_0 embedding tied, 49,152 x 576, the decode
step's largest read) it installs `head_product`: one row of x, a batch-1 decode step's, takes the wide loop
(`gguf_linear_wide`: four weight rows a pass, their sub-blocks interleaved so that the outputs' chains of
fmas overlap, the rows ahead prefetched), which reads the matrix near a plain read's speed where the
sub-block loop, one weight row at a time, waited on each output's chain; the same bits. At a `GgufEmbedding`
(the token embedding kept in its blocks) it installs `embedding_rows`: the step's rows dequantized in one
call of `gguf_dequantize` instead of the lookup's PyTorch ops (the same values).

Where an attention's q, k and v (or an MLP's gate and up) are block matrices of one type, it also
installs `BlockGroup` at the models' `FusedProjection` seam (`Attention.fused_qkv`,
`FeedForward.fused_gate_up`, with SwiGLU's one-pass kernel after it): one call multiplies all of them
(`gguf_linear_group`), the activations quantized once and one parallel region over all their rows,
each output the same bits as its own matrix's product. A decode step of SmolLM2-135M then makes 4
block products per layer instead of 7; on one thread its CPU time did not change beyond the noise
(the calls saved are ~2% of a step; the fewer parallel regions are for two threads, unmeasured on a
quiet machine: docs/benchmarks.md, #53).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from tessera.config.errors import ConfigError
from tessera.infer.cpu import attention as cpu_attention

KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
MAX_ROWS = 32  # rows of x up to which the integer products beat dequantizing the matrix once (measured)
PATHS = ("avx512", "avx2", "portable")  # the block products' loops, widest first (`block_isa`)


def block_isa(path: str | None = None) -> str:
    """The loops every block product of this process takes from now on (gguf_linear, the group, the wide head,
    the layer ops, quant_linear): the widest this CPU has, at most `path` (one of `PATHS`; None: unchanged);
    returns the one they take. The same bits on each; tests and benches compare them in one process."""
    if path is not None and path not in PATHS:
        raise ConfigError(f"block_isa: no path {path!r}; paths: {', '.join(PATHS)}")
    return torch.ops.tessera_cpu.block_isa(path)


@contextlib.contextmanager
def loops(path: str) -> Iterator[str]:
    """`block_isa(path)` within the block (yielding the path taken), the previous path after."""
    before = block_isa()
    try:
        yield block_isa(path)
    finally:
        block_isa(before)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, out_features: int,
                bias: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """x [..., in] (fp32, CPU) times the `kind` block matrix `blocks` ([out, row bytes] uint8) transposed,
    plus `bias`: [..., out]. `portable`: the portable loops instead of AVX2 (the same bits)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.tessera_cpu.gguf_linear(rows, blocks, kind, out_features, bias, portable)
    return y.reshape(*x.shape[:-1], out_features)


def block_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer`'s product by the kernel (a `GgufLinear.fused`), or None where it keeps the reference
    (autograd on, activations not fp32 on CPU); past `MAX_ROWS` rows, the reference's product with
    the matrix dequantized by `gguf_dequantize` (the same values)."""
    return _product(x, layer.blocks, layer.kind, layer.out_features, layer.in_features, layer.bias)


def head_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`block_product` for a model's output head (a wide matrix: `use_block_kernels` installs it there): one
    row of x (a batch-1 decode step) takes the wide loop (`gguf_linear_wide`: weight rows four at a time,
    interleaved, the rows ahead prefetched; the same bits), more rows `block_product`'s way."""
    if (x.numel() != x.shape[-1] or torch.is_grad_enabled() or x.dtype != torch.float32
            or x.device.type != "cpu"):
        return block_product(layer, x)
    y = torch.ops.tessera_cpu.gguf_linear_wide(x.reshape(1, -1), layer.blocks, layer.kind, layer.out_features,
                                               layer.bias)
    return y.reshape(*x.shape[:-1], layer.out_features)


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """A `GgufEmbedding`'s lookup (as its `fused`): the rows of `ids` dequantized by `gguf_dequantize` in one
    call (gguf_blocks' values bit for bit, which its own lookup computes in several PyTorch ops), or None
    where ids are not on the CPU or the embedding is not fp32."""
    if ids.device.type != "cpu" or embedding.dtype != torch.float32:
        return None
    flat = ids.reshape(-1)
    rows = torch.ops.tessera_cpu.gguf_dequantize(embedding.blocks.index_select(0, flat), embedding.kind, flat.numel(),
                                                 embedding.embedding_dim)
    return rows.reshape(*ids.shape, embedding.embedding_dim)


def expert_product(projection: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor | None:
    """Expert e's rows x times its matrix of `projection` (an `ExpertBlocks`, as its `fused`), as
    `block_product` multiplies a layer's."""
    blocks = projection.blocks[e]  # [out, row bytes], a contiguous view
    return _product(x, blocks, projection.kind, projection.out_features, projection.in_features, None)


def _product(x: torch.Tensor, blocks: torch.Tensor, kind: str, out_features: int, in_features: int,
             bias: torch.Tensor | None) -> torch.Tensor | None:
    if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.numel() > MAX_ROWS * x.shape[-1]:  # the reference's bits, its matrix dequantized in C++
        weight = torch.ops.tessera_cpu.gguf_dequantize(blocks, kind, out_features, in_features)
        return torch.nn.functional.linear(x, weight, bias)
    return gguf_linear(x, blocks, kind, out_features, bias)


def gguf_linear_group(x: torch.Tensor, blocks: list[torch.Tensor], kind: str, sizes: list[int],
                      bias: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """x [..., in] times each `kind` block matrix of `blocks` (the i-th [sizes[i], row bytes]), their
    outputs side by side: [..., sum(sizes)], each column the bits `gguf_linear` gives for it alone."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.tessera_cpu.gguf_linear_group(rows, blocks, kind, sizes, bias, portable)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class BlockGroup:
    """`members` (GgufLinear layers over one input, one block type with a kernel) as one product
    (`gguf_linear_group`): called with x, their outputs in order (views of one result), or None where
    the members must run one by one: autograd on, activations not fp32 on CPU, more than `MAX_ROWS`
    rows (each member then dequantizes its matrix once), a hook on a member (it must see its own call),
    or a member whose kernel was taken off."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.kind = members[0].kind
        self.sizes = [m.out_features for m in members]

    def _bias(self) -> torch.Tensor | None:
        if all(m.bias is None for m in self.members):
            return None
        return torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features)
                          for m in self.members])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.numel() > MAX_ROWS * x.shape[-1]
                or any(m.fused is not block_product or m._forward_hooks or m._forward_pre_hooks for m in self.members)):
            return None
        y = gguf_linear_group(x, [m.blocks for m in self.members], self.kind, self.sizes, self._bias())
        return y.split(self.sizes, dim=-1)


def _group(module: nn.Module, names: tuple[str, ...]) -> BlockGroup | None:
    """A `BlockGroup` of `module`'s layers `names` where all are kernel-backed block matrices of one type
    and input width, else None."""
    layers = [getattr(module, name, None) for name in names]
    if any(getattr(layer, "fused", None) is not block_product for layer in layers):
        return None
    if len({(layer.kind, layer.in_features) for layer in layers}) != 1:
        return None
    return BlockGroup(layers)


def group_projections(model: nn.Module) -> int:
    """Install a `BlockGroup` at every attention's `fused_qkv` and every SwiGLU / GeGLU MLP's
    `fused_gate_up` whose members are kernel-backed block matrices of one type (after
    `block_product` is installed), with SwiGLU's one-pass kernel (`silu_mul`) at `fused_act`;
    returns how many seams took one."""
    from tessera.models.attention import Attention
    from tessera.models.mlp import FeedForward

    n = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.fused_qkv is None:
            module.fused_qkv = group = _group(module, ("wq", "wk", "wv"))
        elif isinstance(module, FeedForward) and module.fused_gate_up is None:
            module.fused_gate_up = group = _group(module, ("w1", "w3"))
            if group is not None and module.activation == "silu" and module.fused_act is None:
                module.fused_act = torch.ops.tessera_cpu.silu_mul
        else:
            continue
        n += group is not None
    return n


def use_block_kernels(model: nn.Module) -> int:
    """Install `block_product` at every CPU `GgufLinear` of `model` whose type has a kernel (`head_product`
    at its output head, `model.output`), `expert_product` at every such `ExpertBlocks` (a projection of
    kept experts), `embedding_rows` at every such `GgufEmbedding`, and the grouped products over the
    layers (`group_projections`); returns how many matrices took the kernel (embeddings not counted; 0
    where the library is not available)."""
    from tessera.models.gguf_linear import GgufEmbedding, GgufLinear
    from tessera.models.moe.gguf_experts import ExpertBlocks

    if not cpu_attention.library_available():
        return 0
    layers = [m for m in model.modules()
              if isinstance(m, GgufLinear | ExpertBlocks) and m.kind in KINDS and m.blocks.device.type == "cpu"]
    for layer in layers:
        layer.fused = block_product if isinstance(layer, GgufLinear) else expert_product
    head = getattr(model, "output", None)
    if head in layers and isinstance(head, GgufLinear):
        head.fused = head_product
    for embedding in model.modules():
        if isinstance(embedding, GgufEmbedding) and embedding.kind in KINDS and embedding.blocks.device.type == "cpu":
            embedding.fused = embedding_rows
    group_projections(model)
    return len(layers)
