"""Load a pre-quantized HuggingFace directory (compressed-tensors, DeepSeek-V3 block FP8) with its
quantized linear layers kept quantized in memory.

    model, layers = load_prequantized("path/to/Llama-W4A16", dtype=torch.bfloat16)

The model is built on the meta device from config.json; each linear layer of the blocks that the
checkpoint stores quantized (schemes.QuantizationPlan) is taken out, the rest of the model gets
storage in `dtype` and is filled from the files, then the quantized layers go back in, their
buffers the stored tensors themselves (codes in their stored dtype, scales as stored), so no
full-precision copy of a quantized weight is ever made. The linear layers of attention, MLA and
dense / shared-expert MLPs load quantized, and so do routed experts (one quantized layer per
expert and projection, in a `StoredQuantExperts`) when every projection of every expert of the
layer is stored quantized; a layer whose experts are stored partly quantized, a quantized output
head, embedding or router is refused by name, and so is any tensor the model has no place for
(e.g. KV-cache scales). The library that writes compressed-tensors is not needed to read it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from tessera.checkpoint.hf.files import SafetensorsDir
from tessera.checkpoint.hf.names import hf_fused_rows, hf_names, unread
from tessera.checkpoint.prequantized.detect import quantization_config
from tessera.checkpoint.prequantized.schemes import QuantizationPlan
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import read_hf_config
from tessera.models.int8 import quantizable_layers, replace_module
from tessera.models.moe.experts import GroupedExperts
from tessera.models.stored_quant import StoredQuantLinear
from tessera.models.stored_quant_experts import PROJECTIONS, StoredQuantExperts
from tessera.models.transformer import Transformer

QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_scale_inv", ".weight_zero_point", ".weight_shape",
                  ".weight_g_idx", ".input_scale")
CODE_DTYPES = {"weight_packed": (torch.int32,), "weight_zero_point": (torch.int32, torch.int8),
               "weight_g_idx": (torch.int32, torch.int64)}  # `weight`: the layer's own (int8 or float8_e4m3fn)


def _raw(files: SafetensorsDir, key: str, source: str) -> torch.Tensor:
    try:
        return files.handle(files.files[key]).get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{source}: cannot read tensor {key!r} ({e}); the file may be damaged") from e


def _quantized_prefix(key: str, stored: set[str]) -> bool:
    prefix = key.removesuffix(".weight")
    return any(prefix + s in stored for s in QUANT_SUFFIXES) or key.endswith(QUANT_SUFFIXES)


def _fill_layer(layer: StoredQuantLinear, prefix: str, files: SafetensorsDir, dtype: torch.dtype,
                device: torch.device, source: str) -> set[str]:
    """Give `layer` (built on meta) the stored tensors `prefix.<name>`; returns the keys used."""
    used = set()
    for name, t in list(layer.named_buffers()) + list(layer.named_parameters()):
        key = f"{prefix}.{name}"
        if key not in files.files:
            raise CheckpointError(f"{source}: {prefix} is quantized but the checkpoint has no {key!r}")
        stored = _raw(files, key, source)
        # The codes of `weight` are what the layer's scheme says (int8 or float8_e4m3fn), never the other:
        # int8 codes read as e4m3 (or the reverse) would be served as wrong weights without a word.
        dtypes = (t.dtype,) if name == "weight" else CODE_DTYPES.get(name)
        if dtypes is not None and stored.dtype not in dtypes:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"{source}: {key!r} is {str(stored.dtype).removeprefix('torch.')}; the scheme "
                                  f"stores it as {allowed}")
        if stored.numel() != t.numel() or (name in ("weight", "weight_packed") and stored.shape != t.shape):
            raise CheckpointError(f"{source}: {key!r} has shape {list(stored.shape)}; the model needs "
                                  f"{list(t.shape)}")
        stored = stored.reshape(t.shape).to(device)
        if name == "weight_shape" and stored.tolist() != [layer.out_features, layer.in_features]:
            raise CheckpointError(f"{source}: {key!r} is {stored.tolist()}; the model needs "
                                  f"{[layer.out_features, layer.in_features]}")
        if name == "bias":
            layer.bias = nn.Parameter(stored.to(dtype), requires_grad=False)
        else:
            layer._buffers[name] = stored if name != "input_scale" else stored.float()
        used.add(key)
    return used


# Tessera module name -> (its quantized module on meta, [(HuggingFace prefix, quantized linear inside it)])
Planned = dict[str, tuple[nn.Module, list[tuple[str, StoredQuantLinear]]]]


def _plan_experts(name: str, m: GroupedExperts, plan: QuantizationPlan, names: dict[str, list[str]],
                  stored: set[str]) -> tuple[nn.Module, list[tuple[str, StoredQuantLinear]]] | None:
    """Routed experts `name` as a StoredQuantExperts when the checkpoint stores them quantized (None
    when it stores them full precision; refused when it stores only some of them quantized)."""
    E, hidden, dim = m.w1.shape
    prefixes = {p: [k.removesuffix(".weight") for k in names[f"{name}.{p}"]] for p in PROJECTIONS}
    inputs = {"w1": dim, "w2": hidden, "w3": dim}
    factories = {p: [plan.factory(pre, inputs[p], stored) for pre in prefixes[p]] for p in PROJECTIONS}
    kept = [(pre, f is not None) for p in PROJECTIONS for pre, f in zip(prefixes[p], factories[p], strict=True)]
    if not any(q for _, q in kept):
        return None
    if not all(q for _, q in kept):
        quantized, full = next(pre for pre, q in kept if q), next(pre for pre, q in kept if not q)
        raise ConfigError(f"{plan.source}: {name} has routed experts stored partly quantized ({quantized} quantized, "
                          f"{full} not); Tessera loads a layer's routed experts all quantized or all full precision")
    with torch.device("meta"):
        experts = StoredQuantExperts(E, dim, hidden, m.w1.dtype, factories)
    return experts, [(pre, getattr(experts, p)[e]) for p in PROJECTIONS for e, pre in enumerate(prefixes[p])]


def _plan_layers(model: Transformer, plan: QuantizationPlan, names: dict[str, list[str]], stored: set[str]
                 ) -> Planned:
    """The modules the checkpoint stores quantized, by Tessera name, with their quantized layers."""
    layers: Planned = {}
    for name, m in quantizable_layers(model):
        if isinstance(m, GroupedExperts):
            planned = _plan_experts(name, m, plan, names, stored)
            if planned is not None:
                layers[name] = planned
            continue
        hf = names.get(f"{name}.weight", [])
        if not isinstance(m, nn.Linear) or len(hf) != 1:
            continue
        prefix = hf[0].removesuffix(".weight")
        factory = plan.factory(prefix, m.in_features, stored)
        if factory is not None:
            with torch.device("meta"):
                layer = factory(m.in_features, m.out_features, m.bias is not None, m.weight.dtype)
            layers[name] = layer, [(prefix, layer)]
    return layers


@torch.no_grad()
def _fill_full_precision(model: Transformer, names: dict[str, list[str]], files: SafetensorsDir,
                         stored: set[str], source: str) -> set[str]:
    used = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in names:
            if name.endswith("expert_bias"):
                t.zero_()
            continue
        for key in names[name]:
            if _quantized_prefix(key, stored):
                raise ConfigError(
                    f"{source}: {key.removesuffix('.weight')} is stored quantized, which Tessera does not load for "
                    f"{name} (quantized it loads the linear layers of attention, MLA, dense / shared-expert MLPs and "
                    "routed experts, not the output head, embedding or router); such modules must be in the "
                    "quantization's ignore list")
            if key not in stored:
                raise CheckpointError(f"{source}: no tensor {key!r} (for {name})")
        parts = [_raw(files, k, source) for k in names[name]]
        value = parts[0] if len(parts) == 1 else torch.stack(parts)
        if not value.is_floating_point():
            raise CheckpointError(f"{source}: {names[name][0]!r} is {str(value.dtype).removeprefix('torch.')}; "
                                  "tensors outside the quantized linear layers must be floating point")
        if tuple(value.shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: {names[name][0]!r} has shape {list(value.shape)}; the model needs "
                                  f"{list(t.shape)}")
        t.copy_(value.to(t.dtype))
        used.update(names[name])
    return used


def load_prequantized(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> tuple[Transformer, list[str]]:
    """The model of pre-quantized HuggingFace directory `path` and the names of its quantized layers."""
    path, device = Path(path), torch.device(device)
    source = f"pre-quantized directory {str(path)!r}"
    plan = QuantizationPlan(quantization_config(path), source)
    cfg = read_hf_config(path)
    if hf_fused_rows(cfg):
        raise CheckpointError(f"{source}: family {cfg.family!r} keeps q, k, v and gate/up fused (qkv_proj, "
                              "gate_up_proj), whose quantized blocks Tessera does not split; load a full-precision "
                              "copy")
    names = hf_names(cfg)
    files = SafetensorsDir(path)
    stored = files.keys()
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    layers = _plan_layers(model, plan, names, stored)
    if not layers:
        raise CheckpointError(f"{source}: its quantization_config quantizes none of the model's linear layers")
    for name in layers:
        replace_module(model, name, nn.Identity())
    model.to_empty(device=device)
    model.cast(dtype)
    used = _fill_full_precision(model, names, files, stored, source)
    for name, (module, parts) in layers.items():
        for prefix, layer in parts:
            used |= _fill_layer(layer, prefix, files, dtype, device, source)
        replace_module(model, name, module)
    extra = sorted(k for k in stored - used if not unread(cfg, k)
                   and not (k == "lm_head.weight" and cfg.tie_embeddings))
    if extra:
        raise CheckpointError(f"{source}: it has {extra[0]!r}, which the model has no place for ({len(extra)} such "
                              "tensors; KV-cache scales and quantized modules other than block linear layers are "
                              "not supported)")
    model.reset_rope(device)
    return model.eval(), list(layers)
