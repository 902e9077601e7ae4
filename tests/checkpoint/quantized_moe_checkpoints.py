"""Tiny pre-quantized MoE directories whose routed experts are stored quantized, for the quantized
experts' tests.

transformers keeps an MoE model's routed experts fused (3-D parameters, not nn.Linear), which the
compressed-tensors library does not quantize; the checkpoint, though, stores every expert's
projections as separate linear weights (`...experts.{j}.gate_proj.weight`). So the library is given
those linear layers as they are in the file: a module tree of nn.Linear under the checkpoint's own
names (every 2-D weight of the blocks: attention, router, experts), to which it applies the
QuantizationConfig, whose weight scales it computes (`calculate_qparams`) and which it compresses
(`ModelCompressor.compress_model`) and writes into config.json (`update_config`). The library's
`decompress_model` on the same tree then gives the reference weights, and its modules' forward (the
input fake-quantized as the scheme says) the reference products.

Block FP8 is written as DeepSeek-V3 stores it (`quant_method: "fp8"`, `weight_scale_inv` per
block), experts included, by `block_fp8_quantize`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.checkpoint.quantized_checkpoints import block_fp8_quantize, scheme, weight_qparams
from tests.infer.tiny_models import write_model

ROUTER = "re:.*\\.gate$"  # the router is a linear layer in the file; it stays full precision


def block_linear_keys(state: dict[str, torch.Tensor]) -> list[str]:
    """The 2-D weights of the transformer blocks: every linear layer (attention, MLPs, router, experts)."""
    return [k for k, t in state.items() if k.startswith("model.layers.") and k.endswith(".weight") and t.dim() == 2]


def linear_tree(state: dict[str, torch.Tensor], keys: list[str]) -> nn.Module:
    """nn.Linear modules holding `state[key]` at the module path of each key (without `.weight`)."""
    root = nn.Module()
    for key in keys:
        *path, leaf = key.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        w = state[key]
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.detach().clone().float()
        parent.add_module(leaf, linear)
    return root


def _write_state(path: Path, state: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def compress_directory(path: Path, kind: str, group_size: int = 16, targets=("Linear",), ignore=(ROUTER,)) -> nn.Module:
    """Rewrite the HuggingFace directory at `path` (one model.safetensors) as compressed-tensors: every
    block linear layer the targets match, routed experts included, quantized by `scheme(kind,
    group_size)` by the library. Returns the library's linear tree, compressed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    state = load_file(str(path / "model.safetensors"))
    keys = block_linear_keys(state)
    tree = linear_tree(state, keys)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=list(targets),
                                                                         **scheme(kind, group_size))},
                            ignore=list(ignore))
    apply_quantization_config(tree, qc)
    for m in tree.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            weight_qparams(m)
    tree.compressor = ModelCompressor.from_pretrained_model(tree)
    tree.compressor.compress_model(tree)
    _write_state(path, {k: v for k, v in state.items() if k not in keys} | dict(tree.state_dict()))
    tree.compressor.update_config(str(path))
    return tree


def write_compressed_moe(path: Path, kind: str, family: str = "qwen3_moe", group_size: int = 16,
                         targets=("Linear",), ignore=(ROUTER,)) -> tuple[nn.Module, Path]:
    """A compressed-tensors directory at `path` of a tiny random `family` model (`compress_directory`).
    Returns the library's linear tree, decompressed (module docstring), and a full-precision
    directory beside `path` holding the decompressed weights (transformers loads it: the reference)."""
    write_model(path, family)
    state = load_file(str(path / "model.safetensors"))
    tree = compress_directory(path, kind, group_size, targets, ignore)
    tree.compressor.decompress_model(tree)
    reference = path.parent / f"{path.name}-decompressed"
    write_model(reference, family)
    decompressed = {f"{n}.weight": m.weight.detach().float() for n, m in tree.named_modules()
                    if isinstance(m, nn.Linear)}
    _write_state(reference, state | decompressed)
    return tree, reference


def block_fp8_directory(path: Path, block: tuple[int, int], quantize=None) -> None:
    """Rewrite the HuggingFace directory at `path` as DeepSeek-V3 stores block FP8: the block linear
    weights `quantize(key)` picks (default: all but the routers) as e4m3 codes with
    `weight_scale_inv` per block, and config.json's `quantization_config`."""
    state = load_file(str(path / "model.safetensors"))
    stored = dict(state)
    pick = quantize or (lambda k: not k.endswith(".gate.weight"))
    for key in [k for k in block_linear_keys(state) if pick(k)]:
        stored[key], stored[key.removesuffix("weight") + "weight_scale_inv"] = block_fp8_quantize(state[key], block)
    _write_state(path, stored)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def write_block_fp8_moe(path: Path, family: str, block: tuple[int, int], quantize=None):
    """A block-FP8 directory at `path` of a tiny random `family` model (`block_fp8_directory`).
    Returns the full-precision transformers model it was made from."""
    model = write_model(path, family)
    block_fp8_directory(path, block, quantize)
    return model
