"""Writing a quantized model as a HuggingFace directory in compressed-tensors format.

The tensors are the model's under their HuggingFace names (the family's `tensor_names`), in the
source's stored dtype, except that each quantized linear layer's `weight` is replaced by the
tensors of `formats.stored_tensors`. They go through the one HuggingFace writer
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


def compressed_state(model: Transformer, quantized: dict[str, QuantizedWeight], scheme: Scheme,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HuggingFace name -> tensor: `quantized` (Tessera module name -> weight) in the format's
    tensors, every other tensor cast to `dtype`."""
    state, out = model.state_dict(), {}
    for key, (hf_key,) in hf_names(model.cfg).items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in quantized:
            out.update(stored_tensors(hf_key.removesuffix(".weight"), quantized[module], scheme))
        else:
            out[hf_key] = state[key].detach().to(dtype).contiguous()
    return out


def write_compressed(model: Transformer, quantized: dict[str, QuantizedWeight], scheme: Scheme,
                     dtype: torch.dtype, src: Path, dst: Path) -> None:
    """Write `dst` (module docstring); nothing is left there if a step fails."""
    state = compressed_state(model, quantized, scheme, dtype)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    created = not dst.exists()
    try:
        write_hf_directory(dst, model.cfg, dtype, sizes, lambda keys: {k: state[k] for k in keys})
        hf = read_json_object(src / "config.json") | {"quantization_config": quantization_config(scheme, IGNORED)}
        with atomic_output(dst / "config.json") as tmp:
            tmp.write_text(json.dumps(hf, indent=2))
        for name in COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, dst / name)
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise
