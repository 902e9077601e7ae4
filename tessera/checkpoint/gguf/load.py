"""A Tessera model from a GGUF file: its weights dequantized into the dtype asked for.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)

The config comes from the file's metadata through the family's HuggingFace mapping (reader.py
makes config.json's fields), so a GGUF model is the same `Transformer` a HuggingFace directory of
that family gives. The model is built on the meta device, given storage, and filled one GGUF
tensor at a time (each dequantized to float32, cast, copied, dropped), so the float32 copy of the
whole model never exists beside it. The weights are plain float tensors afterwards: GGUF's
quantization saves disk, not memory (int8 at load, `--quantization int8`, applies on top).
"""

from __future__ import annotations

import os

import torch

from tessera.checkpoint.gguf.reader import GGUFFile
from tessera.checkpoint.hf.names import hf_names
from tessera.checkpoint.hf.writer import first_keys
from tessera.config.errors import ConfigError, ModelError
from tessera.config.hf_config import config_from_hf
from tessera.config.model import ModelConfig
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
              device: str | torch.device = "cpu") -> Transformer:
    """The model in GGUF file `path`, in eval mode, in `dtype` on `device` (the routing bias and
    RoPE buffers as `Transformer.cast` keeps them). Every tensor of the model must come from the
    file once, with the model's shape; a tensor the model has no place for is refused."""
    found = GGUFFile.open(path)
    cfg = gguf_model_config(found)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    model.to_empty(device=device)
    model.cast(dtype)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    by_hf = {hf[0]: key for key, hf in hf_names(cfg).items()}  # dense families: one HF tensor per key
    filled: set[str] = set()
    for hf_name, values in found.tensors():
        key = by_hf.get(hf_name)
        if key is None:
            raise ConfigError(f"{str(found.path)!r}: tensor {hf_name!r} has no place in the {cfg.family} model its "
                              "metadata describes")
        if tuple(values.shape) != tuple(targets[key].shape):
            raise ConfigError(f"{str(found.path)!r}: tensor {hf_name!r} has shape {list(values.shape)}, but the model "
                              f"its metadata describes needs {list(targets[key].shape)}")
        targets[key].copy_(values)
        filled.add(key)
    missing = set(by_hf.values()) - filled
    if missing:
        raise ConfigError(f"{str(found.path)!r}: {len(missing)} tensor(s) of the {cfg.family} model are missing "
                          f"from the file: {first_keys(missing)}")
    model.reset_rope(device)
    return model.eval()
