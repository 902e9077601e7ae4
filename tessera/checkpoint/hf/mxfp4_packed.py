"""gpt-oss's MXFP4 experts kept packed when a HuggingFace directory is served (`gguf_keep_quantized`,
as for a GGUF file): each layer's `BiasedExperts` is swapped, on the meta device, for the
`Mxfp4Experts` a GGUF file's MXFP4 experts load into (models/moe/mxfp4_experts.py), and the
directory's codes and exponents are repacked into that module's blocks without being dequantized.

The two layouts hold the same numbers in different byte orders (mxfp4.py, models/gguf_blocks.py):

    HuggingFace  `{name}_blocks` [E, O, G, 16]: value 2j in byte j's low nibble, 2j + 1 in its high one;
                 `{name}_scales` [E, O, G]: the block's biased exponent
    GGUF block   17 bytes per 32 values: the exponent byte, then value j in byte j's low nibble and
                 value j + 16 in its high one (Q4_0's order)

The exponent byte means 2^(e - 127) in both. HuggingFace's `gate_up_proj` rows interleave gate and
up (row 2f is gate f, row 2f + 1 up f); `Mxfp4Experts` keeps gate and up apart, so the even rows
become `gate_blocks` and the odd ones `up_blocks`. Everything else loads as `load_hf_shards` loads
it (the biases, attention, router, embeddings). Only a whole model on one rank: tensor and expert
parallelism take the dequantized weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.checkpoint.hf.load import checked_directory, load_hf_shards
from tessera.checkpoint.hf.slices import HFSliceReader
from tessera.models.int8 import replace_module
from tessera.models.moe.biased_experts import BiasedExperts
from tessera.models.moe.mxfp4_experts import Mxfp4Experts
from tessera.models.transformer import Transformer

PARTS = ("gate_up_proj", "down_proj")


def gguf_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HuggingFace's [E, O, G, 16] codes and [E, O, G] exponents -> GGUF MXFP4 rows [E, O, G * 17]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [E, O, G, 32], value order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], nibbles], dim=-1).flatten(-2)


def _packed_experts(model: Transformer, reader: HFSliceReader) -> list[str]:
    """Swap every `BiasedExperts` whose two matrices the directory stores in MXFP4 for an
    `Mxfp4Experts` (the model is on the meta device); returns the swapped modules' names."""
    moe, swapped = model.cfg.moe, []
    for name, module in list(model.named_modules()):
        hf = [reader.names.get(f"{name}.{p}", [None])[0] for p in PARTS]
        if isinstance(module, BiasedExperts) and all(h in reader.mxfp4.pairs for h in hf):
            replace_module(model, name, Mxfp4Experts(moe.num_experts, model.cfg.dim, moe.ffn_dim, moe.swiglu_alpha,
                                                     moe.swiglu_limit))
            swapped.append(name)
    return swapped


def _codes(reader: HFSliceReader, key: str) -> torch.Tensor:
    """Tessera key `key`'s MXFP4 pair, whole, as GGUF rows."""
    blocks_key, scales_key = reader.mxfp4.pairs[reader.names[key][0]]
    E, O, G, _ = reader._stored_shape(blocks_key)  # noqa: SLF001 (the header's shape, as the reader reads it)
    blocks = reader.mxfp4.raw(blocks_key, (0, 0, 0, 0), (E, O, G, 16))
    return gguf_mxfp4_rows(blocks, reader.mxfp4.raw(scales_key, (0, 0, 0), (E, O, G)))


@torch.no_grad()
def load_mxfp4_packed(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Transformer:
    """The model of HuggingFace directory `path` (checked as `load_pretrained` checks it) with its
    MXFP4 experts kept packed, in eval mode, in `dtype` on `device`."""
    cfg, shapes = checked_directory(path)
    reader = HFSliceReader(path, cfg)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
        swapped = _packed_experts(model, reader)
    model.to_empty(device=device)
    model.cast(dtype)
    load_hf_shards([model], path, cfg, device, shapes=shapes, source=f"HuggingFace directory {str(Path(path))!r}")
    modules = dict(model.named_modules())
    for name in swapped:
        experts = modules[name]
        gate_up = _codes(reader, f"{name}.gate_up_proj")
        experts.gate_blocks.copy_(gate_up[:, 0::2])
        experts.up_blocks.copy_(gate_up[:, 1::2])
        experts.down_blocks.copy_(_codes(reader, f"{name}.down_proj"))
    return model.eval()
