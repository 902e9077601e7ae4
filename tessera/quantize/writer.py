"""Writing a quantized model as a HuggingFace directory in compressed-tensors format.

The tensors are the model's under their HuggingFace names (the family's `tensor_names`), in the
source's stored dtype, except that each quantized linear layer's `weight` is replaced by the
tensors of `formats.stored_tensors` (a routed expert's projections, one HuggingFace linear layer
per expert, each its own). They go through the one HuggingFace writer
(`write_hf_directory`: shards, index, crash-safe); config.json is then the source's own with
`quantization_config` added, and the source's tokenizer and generation files are copied as they
are, so that the directory differs from the source in its weights alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tessera.checkpoint.hf.names import hf_names
from tessera.checkpoint.hf.writer import write_hf_directory
from tessera.config.hf_config import read_json_object
from tessera.data.atomic_write import atomic_output
from tessera.models.transformer import Transformer
from tessera.quantize.formats import QuantizedWeight, Scheme, quantization_config, stored_tensors

# Files of a HuggingFace directory besides config and weights, copied byte for byte where the source has them.
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
          "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
IGNORED = ["lm_head"]  # the output head stays in full precision (as llm-compressor's recipes leave it)


def ignored_modules(model: Transformer) -> list[str]:
    """compressed-tensors' `ignore`: the output head, and each MoE layer's router (a linear layer in
    the HuggingFace file, which a reader's "Linear" target would otherwise expect quantized)."""
    names = hf_names(model.cfg)
    routers = [names[k][0].removesuffix(".weight") for k in names if k.endswith(".moe.router.weight")]
    return IGNORED + routers


def compressed_state(model: Transformer, quantized: dict[str, QuantizedWeight | list[QuantizedWeight]],
                     scheme: Scheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HuggingFace name -> tensor: `quantized` (Tessera module name -> weight; routed experts'
    parameter name -> one weight per expert) in the format's tensors, every other tensor cast to
    `dtype` (routed experts' [E, out, in] split into the file's E tensors)."""
    state, out = model.state_dict(), {}
    for key, hf_keys in hf_names(model.cfg).items():
        q = quantized.get(key.removesuffix(".weight") if key.endswith(".weight") else key)
        if q is None:
            value = state[key].detach().to(dtype)
            parts = [value] if len(hf_keys) == 1 else list(value)
            out.update({k: v.contiguous() for k, v in zip(hf_keys, parts, strict=True)})
            continue
        for hf_key, qe in zip(hf_keys, q if isinstance(q, list) else [q], strict=True):
            out.update(stored_tensors(hf_key.removesuffix(".weight"), qe, scheme))
    return out


def write_compressed(model: Transformer, quantized: dict[str, QuantizedWeight | list[QuantizedWeight]], scheme: Scheme,
                     dtype: torch.dtype, src: Path, dst: Path) -> None:
    """Write `dst` (module docstring); nothing is left there if a step fails."""
    state = compressed_state(model, quantized, scheme, dtype)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    created = not dst.exists()
    try:
        write_hf_directory(dst, model.cfg, dtype, sizes, lambda keys: {k: state[k] for k in keys})
        qc = quantization_config(scheme, ignored_modules(model))
        hf = read_json_object(src / "config.json") | {"quantization_config": qc}
        with atomic_output(dst / "config.json") as tmp:
            tmp.write_text(json.dumps(hf, indent=2))
        for name in COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, dst / name)
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise
