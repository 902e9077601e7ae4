"""The one loader of whole models, from any directory Tessera reads, and what a model came with.

    loaded = load_model(path, dtype=torch.bfloat16)   # loaded.model, loaded.quantized, loaded.run_config
    source = trained_tokenizer(path)                  # where its tokenizer is; tessera.data.load_tokenizer reads it
    tokenizer = model_tokenizer(path)                 # the Tokenizer itself (a GGUF file's too), or None

Three kinds of directory, and one kind of file, hold a model:
- a pre-quantized int8 directory (checkpoint/int8.py: config.json + int8 weights + the list of
  quantized layers);
- a HuggingFace model directory (config.json + safetensors) of a supported family (hf/load.py);
  a pre-quantized one (config.json's `quantization_config`: compressed-tensors or DeepSeek-V3
  block FP8) loads with its quantized layers kept quantized (prequantized/);
- a Tessera checkpoint: `step_N/` with DCP files and meta.json, a `checkpoints/` root or a run
  directory (dcp/model.py), whose tokenizer is its run's `data.tokenizer` (the bundled one when unset);
- a GGUF file (gguf/: llama.cpp's format, dequantized at load, or its quantized block matrices
  kept in memory with `gguf_keep_quantized`), whose tokenizer is in its metadata.
A vision-language model (a LLaVA, Qwen2-VL or Qwen2.5-VL directory, or a Tessera checkpoint converted
from one) loads through `load_vision_language`, with its image processor; `vision_language_family`
names its family.
`tessera generate` and serving load through here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import load_tessera_model, stored_run_config
from tessera.checkpoint.dcp.vision_language import ENTRY as VISION_LANGUAGE_ENTRY
from tessera.checkpoint.dcp.vision_language import is_vision_language_checkpoint, load_vision_language_checkpoint
from tessera.checkpoint.gguf.reader import is_gguf_path
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.int8 import is_quantized_dir, load_quantized
from tessera.checkpoint.prequantized.detect import is_mxfp4_directory, is_prequantized_hf
from tessera.checkpoint.vision_families import is_vision_language_directory, load_directory_model
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import is_hf_directory, read_json_object
from tessera.data.tokenizer import load_tokenizer
from tessera.models.transformer import Transformer
from tessera.models.vision.vision_language import VisionLanguageModel


class LoadedModel(NamedTuple):
    """A model in eval mode, in the dtype and on the device it was asked for (some buffers stay fp32)."""

    model: Transformer
    quantized: list[str] | None  # its quantized layers (a pre-quantized directory), else None
    run_config: dict | None  # the run configuration stored with a Tessera checkpoint (meta.json's plain dict)


def _tessera_checkpoint(path: Path) -> Path | None:
    try:
        return ckpt.resolve_checkpoint(path)
    except CheckpointError:
        return None


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", gguf_keep_quantized: bool = False) -> LoadedModel:
    """The model in a pre-quantized directory, a HuggingFace directory, a Tessera checkpoint or a
    GGUF file (`gguf_keep_quantized`: its quantized block matrices kept so, `load_gguf`; or a
    gpt-oss MXFP4 directory's experts kept packed, hf/mxfp4_packed.py)."""
    path = Path(path)
    if is_gguf_path(path):
        from tessera.checkpoint.gguf.load import load_gguf

        return LoadedModel(load_gguf(path, dtype, device, gguf_keep_quantized), None, None)
    if gguf_keep_quantized and not is_mxfp4_directory(path):
        raise ConfigError(f"gguf_keep_quantized applies to GGUF files and MXFP4 directories (gpt-oss's); "
                          f"{str(path)!r} is neither (serve it without the option)")
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    if is_quantized_dir(path):
        model, layers = load_quantized(path, dtype, device)
        return LoadedModel(model, layers, None)
    if is_prequantized_hf(path):
        from tessera.checkpoint.prequantized.load import load_prequantized

        model, layers = load_prequantized(path, dtype, device)
        return LoadedModel(model, layers, None)
    if is_hf_directory(path):
        if gguf_keep_quantized:  # a gpt-oss MXFP4 directory (checked above)
            from tessera.checkpoint.hf.mxfp4_packed import load_mxfp4_packed

            return LoadedModel(load_mxfp4_packed(path, dtype, device), None, None)
        return LoadedModel(load_pretrained(path, dtype=dtype, device=device), None, None)
    found = _tessera_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: neither a HuggingFace model directory (config.json), a pre-quantized "
                              "directory, nor a Tessera checkpoint (step_*/meta.json)")
    model, run_config = load_tessera_model(found, dtype, device)
    return LoadedModel(model, None, run_config)


def keeps_stored_blocks(path: str | os.PathLike) -> bool:
    """Whether `load_model` can keep the model's stored blocks (`gguf_keep_quantized`): a GGUF file, or
    a gpt-oss directory with MXFP4 experts."""
    return is_gguf_path(path) or is_mxfp4_directory(path)


def is_vision_language(path: str | os.PathLike) -> bool:
    """A vision-language family's HuggingFace directory (LLaVA, Qwen2-VL, Qwen2.5-VL), or a Tessera
    checkpoint converted from one."""
    return is_vision_language_directory(path) or (
        not is_hf_directory(path) and not is_gguf_path(path) and is_vision_language_checkpoint(path))


def vision_language_family(path: str | os.PathLike) -> str:
    """"llava", "qwen2_vl" or "qwen2_5_vl": the family of the vision-language model at `path`."""
    if is_hf_directory(path):
        d = read_json_object(Path(path) / "config.json")
    else:
        d = (ckpt.read_meta(ckpt.resolve_checkpoint(path)).get(VISION_LANGUAGE_ENTRY) or {}).get("config") or {}
    return str(d.get("model_type"))


def load_vision_language(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[VisionLanguageModel, Any, dict | None]:
    """The vision-language model at `path` (`is_vision_language`), its image processor, and the run
    configuration stored with a Tessera checkpoint (None for a HuggingFace directory)."""
    if is_vision_language_directory(path):
        return (*load_directory_model(path, dtype, device), None)
    return load_vision_language_checkpoint(path, dtype, device)


def trained_tokenizer(path: str | os.PathLike) -> str | None:
    """Where the tokenizer a model was trained with is, for `tessera.data.load_tokenizer`: a
    directory holding tokenizer.json is its own (a Tessera run or checkpoint too: a tokenizer copied
    in wins); otherwise a Tessera checkpoint's is its run's `data.tokenizer` ("default", the bundled
    one, when unset), and a model directory has none (None)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return str(path)
    if is_hf_directory(path) or is_quantized_dir(path):
        return None
    data = stored_run_config(ckpt.resolve_checkpoint(path)).get("data") or {}
    source = data.get("tokenizer")
    if source is not None and not isinstance(source, str):
        raise CheckpointError(f"checkpoint {str(path)!r}: data.tokenizer={source!r} in its meta.json is invalid: "
                              "must be a tokenizer path")
    return "default" if source is None else source


def model_tokenizer(path: str | os.PathLike):
    """The `tessera.data.Tokenizer` a model comes with, or None when it has none: a GGUF file's
    own (its metadata), else what `trained_tokenizer` names."""
    if is_gguf_path(path):
        from tessera.checkpoint.gguf.tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)
    source = trained_tokenizer(path)
    return None if source is None else load_tokenizer(source)


def eos_token_ids(path: str | os.PathLike, tokenizer, vocab_size: int) -> set[int]:
    """End-of-sequence ids: generation_config.json's and config.json's eos_token_id, and the
    tokenizer's; each must be a token of the model's vocabulary (a stop rule that can never fire
    would let every request run to max_tokens unnoticed)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            value = read_json_object(f).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            if value is None:
                continue
            if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values):
                raise CheckpointError(f"{str(f)!r}: eos_token_id={value!r} is invalid: must be a token id or a list "
                                      f"of token ids of the model's vocabulary (0..{vocab_size - 1})")
            ids.update(values)
    if tokenizer is not None and tokenizer.eos_id is not None:
        if not 0 <= tokenizer.eos_id < vocab_size:
            raise CheckpointError(f"{path}: the tokenizer's eos_token (id {tokenizer.eos_id}) is outside the model's "
                                  f"vocabulary (0..{vocab_size - 1}); the tokenizer belongs to another model")
        ids.add(tokenizer.eos_id)
    return ids
