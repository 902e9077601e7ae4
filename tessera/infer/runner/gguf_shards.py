"""A GGUF model's kept-quantized block matrices (`GgufLinear`, `gguf_keep_quantized`) cut for
tensor-parallel serving: each rank keeps its part of the file's blocks, never a float copy.

The parallel plan cuts `nn.Linear` weights (as DTensors); a `GgufLinear` holds the bytes of its
blocks instead. So while the plan cuts the model each one is stood in for by a Linear of its shape on
the meta device (`stand_in`), the box the plan gives the stand-in's weight is read off it (`boxes`,
before `to_plain_tensors` turns the weights into local tensors and installs the row-parallel sums),
and the rank's part of the blocks is put back as a `GgufLinear` of that part (`put_back`):

- column-parallel (the weight Shard(0): wq, wk, wv, w1, w3): the rank's output rows, each row's
  blocks whole, so any row split is exact;
- row-parallel (Shard(1): wo, w2): the rank's input columns, which must fall on block edges (32
  values for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, 256 for the K types): each row's blocks from the first
  column's block on. A split inside a block is refused by the layer's name, the type and the edges; the
  partial products are summed over the ranks by the stand-in's hook, moved to the new layer, and its
  bias, like a Linear's, is added on rank 0 only;
- replicated: the whole.

A kept token embedding (`GgufEmbedding`) is dequantized here: every rank looks it up whole, as it does a
float embedding (a tied head stays the embedding's blocks, cut as a column-parallel layer). Routed
experts kept as blocks (`GgufExperts`) are dequantized here too, for expert tensor parallelism cuts
the experts' float tensors.

Each rank's `GgufLinear` then multiplies by its own blocks (the CPU block kernel too, installed on the
shard by the caller). A model with other kept blocks (gpt-oss's MXFP4 experts) is refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessera.config.errors import ConfigError
from tessera.models.gguf_blocks import BLOCKS
from tessera.models.gguf_linear import GgufEmbedding, GgufLinear
from tessera.models.int8 import replace_module
from tessera.models.moe.gguf_experts import GgufExperts
from tessera.models.transformer import Transformer


def stand_in(model: Transformer) -> dict[str, GgufLinear]:
    """Replace every `GgufLinear` of `model` by a meta-device Linear of its shape; returns them by name."""
    kept: dict[str, GgufLinear] = {}
    dtype = next(model.parameters()).dtype  # the model's float dtype (a norm's, where the embedding is kept)
    for name, module in list(model.named_modules()):
        if isinstance(module, GgufLinear):
            kept[name] = module
            replace_module(model, name, nn.Linear(module.in_features, module.out_features,
                                                  bias=module.bias is not None, device="meta"))
        elif isinstance(module, GgufEmbedding):  # looked up whole on every rank: its rows dequantized once
            replace_module(model, name, nn.Embedding.from_pretrained(module.weight, freeze=False))
        elif isinstance(module, GgufExperts):  # expert tensor parallelism cuts float experts
            replace_module(model, name, module.dequantized(dtype, model.cfg.moe.grouped_gemm))
        elif getattr(module, "quantized", False):
            raise ConfigError(f"tensor_parallel_size > 1 cannot cut {name} ({type(module).__name__}, kept in the "
                              "file's blocks): serve this GGUF file with --gguf-dequantize, or on one rank")
    return kept


def boxes(model: Transformer, kept: dict[str, GgufLinear]) -> dict[str, tuple[str, int, int]]:
    """Name -> (how the plan cut the stand-in's weight: "rows", "columns" or "whole"; first; count)."""
    from tessera.checkpoint.hf.slices import local_box

    out = {}
    for name in kept:
        weight = model.get_submodule(name).weight
        placements = weight.placements if isinstance(weight, DTensor) else (Replicate(),)
        cuts = [p for p in placements if not isinstance(p, Replicate)]
        if not cuts:
            out[name] = ("whole", 0, 0)
            continue
        if len(cuts) > 1 or type(cuts[0]) is not Shard or cuts[0].dim not in (0, 1):
            raise ConfigError(f"tensor_parallel_size > 1 cuts {name} as {placements}, which its GGUF blocks cannot "
                              "follow; serve this file with --gguf-dequantize")
        offsets, sizes = local_box(weight)
        dim = cuts[0].dim
        out[name] = ("rows" if dim == 0 else "columns", offsets[dim], sizes[dim])
    return out


def put_back(model: Transformer, kept: dict[str, GgufLinear], cut: dict[str, tuple[str, int, int]],
             rank: int) -> Transformer:
    """Each stand-in replaced by a `GgufLinear` of this rank's part of the blocks (module docstring)."""
    for name, layer in kept.items():
        how, first, n = cut[name]
        new = _part(name, layer, how, first, n, rank)
        for hook in model.get_submodule(name)._forward_hooks.values():  # the row-parallel sum
            new.register_forward_hook(hook)
        replace_module(model, name, new)
    return model


def _part(name: str, layer: GgufLinear, how: str, first: int, n: int, rank: int) -> GgufLinear:
    rows, cols, blocks, bias = layer.out_features, layer.in_features, layer.blocks, layer.bias
    if how == "rows":
        rows, blocks = n, blocks[first:first + n]
        bias = None if bias is None else bias[first:first + n]
    elif how == "columns":
        values, nbytes = BLOCKS[layer.kind]
        if first % values or n % values:
            raise ConfigError(f"tensor_parallel_size > 1 cuts {name}'s {cols} input columns at {first}..{first + n}, "
                              f"inside its {layer.kind} blocks of {values} values: a rank of a row-parallel layer "
                              f"takes whole blocks (a multiple of {values} columns each); serve with "
                              "--gguf-dequantize or a tensor_parallel_size that splits on block edges")
        cols, blocks = n, blocks[:, first // values * nbytes:(first + n) // values * nbytes]
        bias = None if bias is None else (bias if rank == 0 else torch.zeros_like(bias))  # added once
    dtype = bias.dtype if bias is not None else torch.float32
    new = GgufLinear(layer.kind, cols, rows, bias is not None, dtype, device=blocks.device)
    new.blocks.copy_(blocks)  # a copy: the whole matrix's blocks are freed with the stand-in's layer
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return new
