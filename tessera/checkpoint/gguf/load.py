"""A Tessera model from a GGUF file: its weights dequantized into the dtype asked for.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)

The config comes from the file's metadata through the family's HuggingFace mapping (reader.py
makes config.json's fields), so a GGUF model is the same `Transformer` a HuggingFace directory of
that family gives. The model is built on the meta device, given storage, and filled one GGUF
tensor at a time (each dequantized to float32, cast, copied, dropped), so the float32 copy of the
whole model never exists beside it. The weights are plain float tensors afterwards: GGUF's
quantization saves disk, not memory (int8 at load, `--quantization int8`, applies on top).

With `keep_quantized=True` the block-quantized matrices of the attention and MLP linear layers
(every type `tessera.models.gguf_blocks` reads: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K) stay
in memory as the file stores them: the layer becomes a `GgufLinear` holding the blocks' bytes,
dequantized inside each forward. The token embedding and an untied output head stored in a block
type stay so too (`GgufEmbedding`: a lookup dequantizes only the rows it reads); a head tied to such
an embedding becomes a `GgufLinear` over the embedding's own buffer, so the matrix is in memory once
and the head multiplies by its blocks as the other layers do. Those layers are swapped in on the
meta device, so their float weights are never allocated. The norms, any matrix stored as F32 / F16 /
BF16, and a scaled embedding (Gemma's) are dequantized into `dtype` as without the option.
gpt-oss's experts stored in MXFP4 stay so too (`Mxfp4Experts`: the gate, up and down blocks, each
expert dequantized in the forward), and so do routed SwiGLU experts whose gate, up and down the file
stores in block types (`GgufExperts`: GLM-4.5's, Llama 4's, Qwen3-Next's and Qwen3.5's `ffn_*_exps`,
each projection in its own type), multiplied by their blocks as the linear layers are.
"""

from __future__ import annotations

import os
import re

import torch

from tessera.checkpoint.gguf.reader import GGUFFile
from tessera.checkpoint.hf.names import hf_fused_rows, hf_names, hf_parts
from tessera.checkpoint.hf.writer import first_keys
from tessera.config.errors import ConfigError, ModelError
from tessera.config.hf_config import config_from_hf
from tessera.config.model import ModelConfig
from tessera.models.gguf_blocks import BLOCKS
from tessera.models.gguf_linear import GgufEmbedding, GgufLinear
from tessera.models.int8 import replace_module
from tessera.models.lazy_torch import on_meta, to_empty
from tessera.models.moe.biased_experts import BiasedExperts
from tessera.models.moe.experts import GroupedExperts
from tessera.models.moe.gguf_experts import PROJECTIONS, GgufExperts
from tessera.models.moe.mxfp4_experts import Mxfp4Experts
from tessera.models.transformer import Transformer


def gguf_model_config(found: GGUFFile) -> ModelConfig:
    """The `ModelConfig` of an opened GGUF file; ConfigError naming the file when its metadata does
    not describe a model Tessera builds."""
    try:
        return config_from_hf(found.hf_config)
    except (ModelError, ConfigError) as e:
        raise ConfigError(f"{str(found.path)!r}: its metadata does not describe a model Tessera builds: {e}") from None


@torch.no_grad()
def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", keep_quantized: bool = False) -> Transformer:
    """The model in GGUF file `path`, in eval mode, in `dtype` on `device` (the routing bias and
    RoPE buffers as `Transformer.cast` keeps them); `keep_quantized`: its block layers' quantized
    matrices kept as `GgufLinear` blocks. Every tensor of the model must come from the file once,
    with the model's shape; a tensor the model has no place for is refused."""
    found = GGUFFile.open(path)
    cfg = gguf_model_config(found)
    by_hf = _keys_by_hf_name(cfg)
    rows = hf_fused_rows(cfg)
    with on_meta():
        model = Transformer(cfg, init_seed=None)
        kept = _keep_quantized(model, found, by_hf, rows, dtype) if keep_quantized else set()
        kept |= _keep_block_experts(model, found, by_hf) if keep_quantized else set()
        packed = _keep_mxfp4_experts(model, found, dtype) if keep_quantized else {}
    to_empty(model, device)
    model.cast(dtype)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    filled: set[str] = set()
    for stored in found.stored():
        if stored.entry.name in packed:  # gpt-oss's MXFP4 experts, kept as the file's blocks
            buffer, key = packed[stored.entry.name]
            targets[buffer].copy_(stored.raw_blocks().reshape(targets[buffer].shape))
            filled.add(key)
            continue
        keys = by_hf.get(stored.hf_name)
        if keys is None:
            raise ConfigError(f"{str(found.path)!r}: tensor {stored.hf_name!r} has no place in the {cfg.family} "
                              "model its metadata describes")
        quantized = [k for k in keys if k in kept]
        values = stored.raw_blocks() if quantized else stored.dequantized()
        for key, part in _parts(found, stored.hf_name, values, keys, rows):
            if key in kept:  # a layer's [out, row bytes], or the experts' [E, out, row bytes] from [E, rest]
                target = targets[key.removesuffix(".weight") + ".blocks"]
                target.copy_(part.reshape(target.shape))
            else:  # the whole tensor, or its interleaved share of a fused one (gpt-oss's gate / up)
                start, step = stored.into or (0, 1)
                view = stored.select(targets[key]) if stored.select else targets[key][..., start::step]
                _fill(found, stored.hf_name, view, part)
            filled.add(key)
    missing = {k for keys in by_hf.values() for k in keys} - filled
    if missing:
        raise ConfigError(f"{str(found.path)!r}: {len(missing)} tensor(s) of the {cfg.family} model are missing "
                          f"from the file: {first_keys(missing)}")
    if cfg.tie_embeddings and isinstance(model.tok_embeddings, GgufEmbedding):
        _tie_kept_head(model, dtype)
    model.reset_rope(device)
    return model.eval()


def _keys_by_hf_name(cfg: ModelConfig) -> dict[str, list[str]]:
    """HuggingFace name -> the Tessera keys it fills: one per name, several for a fused tensor (Phi-3's
    rows). Routed experts, E HuggingFace tensors of one Tessera tensor, are one name with `*` for the
    expert (`model.layers.1.mlp.experts.*.gate_proj.weight`): GGUF stores them stacked as Tessera does;
    a Tessera tensor that is the i-th part of a fused one (Llama 4's experts) is that name with `#i`,
    in Tessera's [E, out, in] layout as GGUF stores it."""
    by_hf: dict[str, list[str]] = {}
    parts = hf_parts(cfg)
    for key, hf in hf_names(cfg).items():
        name = re.sub(r"\.experts\.0\.", ".experts.*.", hf[0]) if len(hf) > 1 else hf[0]
        by_hf.setdefault(f"{name}#{parts[key].index}" if key in parts else name, []).append(key)
    return by_hf


def _parts(found: GGUFFile, hf_name: str, values: torch.Tensor, keys: list[str],
           rows: dict[str, tuple[int, int]]) -> list[tuple[str, torch.Tensor]]:
    """(key, its values) for each Tessera key of a stored tensor: the whole tensor, or each key's rows
    of a fused one (Phi-3's attn_qkv, ffn_up), whose row count must be the parts' together."""
    if len(keys) == 1 and keys[0] not in rows:
        return [(keys[0], values)]
    total = max(rows[k][1] for k in keys)
    if values.shape[0] != total:
        raise ConfigError(f"{str(found.path)!r}: tensor {hf_name!r} has {values.shape[0]} rows, but the model its "
                          f"metadata describes reads {total} from it")
    return [(k, values[rows[k][0]:rows[k][1]]) for k in keys]


def _fill(found: GGUFFile, hf_name: str, target: torch.Tensor, values: torch.Tensor) -> None:
    if tuple(values.shape) != tuple(target.shape):
        raise ConfigError(f"{str(found.path)!r}: tensor {hf_name!r} has shape {list(values.shape)}, but the model "
                          f"its metadata describes needs {list(target.shape)}")
    target.copy_(values)


def _keep_quantized(model: Transformer, found: GGUFFile, by_hf: dict[str, list[str]],
                    rows: dict[str, tuple[int, int]], dtype: torch.dtype) -> set[str]:
    """Swap every linear layer inside the blocks whose weight the file stores in a block type
    `GgufLinear` reads for one of that type (on the meta device, its bias the layer's own); returns
    the weight keys swapped. A stored shape that does not fit the layer is refused by name."""
    modules = dict(model.named_modules())
    kept = set()
    for stored in found.stored():
        for key in by_hf.get(stored.hf_name, []):
            if _kept(model, modules, found, stored, key, rows, dtype):
                kept.add(key)
    return kept


def _keep_mxfp4_experts(model: Transformer, found: GGUFFile, dtype: torch.dtype) -> dict[str, tuple[str, str]]:
    """Swap each gpt-oss expert block whose gate, up and down the file stores in MXFP4 for an
    `Mxfp4Experts` (on the meta device); returns GGUF tensor name -> (its blocks' buffer, the Tessera
    key it stands for)."""
    modules, moe = dict(model.named_modules()), model.cfg.moe
    by_layer: dict[str, dict[str, str]] = {}
    for stored in found.stored():
        block, _, kind = stored.entry.name.rpartition(".")[0].partition(".")[2].partition(".")
        if stored.kind == "MXFP4" and kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            by_layer.setdefault(block, {})[kind.split("_")[1]] = stored.entry.name
    out = {}
    for block, names in by_layer.items():
        name = f"layers.{block}.moe.experts"
        if len(names) < 3 or not isinstance(modules.get(name), BiasedExperts):
            continue
        replace_module(model, name, Mxfp4Experts(moe.num_experts, model.cfg.dim, moe.ffn_dim, moe.swiglu_alpha,
                                                 moe.swiglu_limit, dtype))
        for part, gguf_name in names.items():
            out[gguf_name] = (f"{name}.{part}_blocks", f"{name}.{'down_proj' if part == 'down' else 'gate_up_proj'}")
    return out


def _keep_block_experts(model: Transformer, found: GGUFFile, by_hf: dict[str, list[str]]) -> set[str]:
    """Swap each routed SwiGLU expert block (`GroupedExperts`) whose gate, up and down the file stores
    in block types, as they lie, for a `GgufExperts` of those types (on the meta device); returns the
    expert keys swapped (`layers.1.moe.experts.w1`: its blocks are `...w1.blocks`). A stored shape that
    does not fit the experts is refused by name."""
    modules = dict(model.named_modules())
    by_module: dict[str, dict] = {}
    for stored in found.stored():
        if stored.kind not in BLOCKS or stored.transposed or stored.into or stored.select or stored.convert or \
                stored.rows is not None:
            continue
        for key in by_hf.get(stored.hf_name, []):
            name, _, part = key.rpartition(".")
            if part in PROJECTIONS and type(modules.get(name)) is GroupedExperts:
                by_module.setdefault(name, {})[part] = stored
    kept = set()
    for name, parts in by_module.items():
        if len(parts) < len(PROJECTIONS):
            continue
        old = modules[name]
        for part, stored in parts.items():  # the shape check
            _fill(found, stored.hf_name, getattr(old, part), torch.empty(stored.shape, device="meta"))
        E, F, D = old.w1.shape
        replace_module(model, name, GgufExperts(E, D, F, {part: stored.kind for part, stored in parts.items()}))
        kept |= {f"{name}.{part}" for part in parts}
    return kept


def _kept(model: Transformer, modules: dict, found: GGUFFile, stored, key: str, rows: dict[str, tuple[int, int]],
          dtype: torch.dtype) -> bool:
    """Swap the layer of weight `key` for a `GgufLinear` of the stored tensor's type, where it is one."""
    name = key.removesuffix(".weight")
    layer = modules.get(name)
    linear = (key.startswith("layers.") or name == "output") and isinstance(layer, torch.nn.Linear)
    embedding = name == "tok_embeddings" and type(layer) is torch.nn.Embedding  # not ScaledEmbedding
    if not ((linear or embedding) and key.endswith(".weight") and stored.kind in BLOCKS and stored.select is None
            and stored.convert is None):
        return False
    shape = (rows[key][1] - rows[key][0], *stored.shape[1:]) if key in rows else stored.shape
    _fill(found, stored.hf_name, layer.weight, torch.empty(shape, device="meta"))  # the shape check
    if embedding:
        new = GgufEmbedding(stored.kind, layer.num_embeddings, layer.embedding_dim, dtype)
    else:
        new = GgufLinear(stored.kind, layer.in_features, layer.out_features, False, dtype)
        new.bias = layer.bias
    replace_module(model, name, new)
    return True


def _tie_kept_head(model: Transformer, dtype: torch.dtype) -> None:
    """The LM head tied to a kept embedding: a `GgufLinear` whose blocks are the embedding's buffer
    (the same storage), in `output`, which the model's head takes before the tied seam."""
    embedding = model.tok_embeddings
    head = GgufLinear(embedding.kind, embedding.embedding_dim, embedding.num_embeddings, False, dtype, device="meta")
    head.blocks = embedding.blocks
    model.output = head
