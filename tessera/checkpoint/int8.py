"""The pre-quantized int8 model directory: config.json, int8 weights, the list of quantized layers.

    save_quantized(model, quantize_model(model, "int8"), "out/", source_dir="path/to/hf")
    model, layers = load_quantized("out/", dtype=torch.bfloat16)

The weights are the state dict of a model whose block layers are int8 (tessera/models/int8.py) in
one safetensors file; `tessera_quantization.json` names the quantized layers, so `load_quantized`
builds those layers int8 on the meta device and reads the directory without any full-precision copy.
The tokenizer files of the source directory are copied beside them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tessera.config.errors import CheckpointError
from tessera.config.hf_config import config_to_hf, read_hf_config, read_json_object
from tessera.models.int8 import empty_int8_layer, replace_module
from tessera.models.transformer import Transformer

QUANT_FILE = "tessera_quantization.json"
WEIGHTS_FILE = "model.int8.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def save_quantized(model: Transformer, quantized: list[str], path: str | Path, source_dir: str | Path | None = None
                   ) -> None:
    """Write a pre-quantized model directory: config.json, int8 weights, the list of quantized
    layers, and the tokenizer files of `source_dir` if given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_cfg = config_to_hf(model.cfg)
    hf_cfg["torch_dtype"] = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (path / QUANT_FILE).write_text(json.dumps({"method": "int8_weight_only", "format": 1, "layers": quantized},
                                              indent=2))
    if source_dir is not None:
        for f in TOKENIZER_FILES:
            if (Path(source_dir) / f).is_file():
                shutil.copy(Path(source_dir) / f, path / f)


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                   ) -> tuple[Transformer, list[str]]:
    """Read a directory written by `save_quantized`."""
    path = Path(path)
    meta = read_json_object(path / QUANT_FILE)
    if meta.get("method") != "int8_weight_only":
        raise CheckpointError(f"{path}: quantization method {meta.get('method')!r} is not supported")
    if not isinstance(meta.get("layers"), list) or not all(isinstance(n, str) for n in meta["layers"]):
        raise CheckpointError(f"{str(path / QUANT_FILE)!r}: 'layers' must be a list of module names")
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
        for name in meta["layers"]:
            new = empty_int8_layer(model.get_submodule(name), dtype)
            if new is None:
                raise CheckpointError(f"{path}: quantized layer {name!r} is not a linear layer or experts")
            replace_module(model, name, new)
    state = load_file(str(path / WEIGHTS_FILE), device=str(device))
    state = {k: (v if v.dtype in (torch.int8,) or k.endswith("scale") or k.endswith("expert_bias")
                 else v.to(dtype)) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the config: {str(e)[:300]}") from e
    model.reset_rope(device)
    return model.eval(), list(meta["layers"])
