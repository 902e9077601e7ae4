"""Find and load what a served model directory holds: weights, tokenizer, end-of-sequence ids.

Three kinds of directory are served:
- a HuggingFace model directory (config.json + safetensors) of a supported family;
- a pre-quantized directory written by `tessera.infer.quant.save_quantized`;
- a Tessera training checkpoint (`step_N/` with DCP files and meta.json, a `checkpoints/` root
  or a run directory): loaded by `tessera.checkpoint.convert.load_tessera_model`, the one loader
  of Tessera checkpoints; the tokenizer comes from the run's `data.tokenizer` (the bundled
  tokenizer when unset).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.checkpoint import dcp
from tessera.checkpoint.convert import load_tessera_model
from tessera.checkpoint.hf import load_pretrained
from tessera.config.errors import CheckpointError
from tessera.config.hf_config import read_json_object
from tessera.infer.quant import is_quantized_dir, load_quantized
from tessera.models.transformer import Transformer


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _tessera_checkpoint(path: Path) -> Path | None:
    try:
        return dcp.resolve_checkpoint(path)
    except CheckpointError:
        return None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> tuple[Transformer, list[str] | None, dict]:
    """(model, names of int8 layers or None, Tessera run config or {}) for any served directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    if is_quantized_dir(path):
        model, layers = load_quantized(path, dtype, device)
        return model, layers, {}
    if (path / "config.json").is_file():
        return load_pretrained(path, dtype=dtype, device=device), None, {}
    if _tessera_checkpoint(path) is not None:
        model, run_cfg = load_tessera_model(path, dtype, device)
        return model, None, run_cfg
    raise CheckpointError(f"{path}: neither a HuggingFace model directory (config.json), a pre-quantized "
                          "directory, nor a Tessera checkpoint (step_*/meta.json)")


def load_tokenizer(path: str | Path, run_cfg: dict | None = None):
    """The tokenizer served with the model, or None when the directory has none (then only
    token-id prompts work). `tessera.data.tokenizer.Tokenizer` reads tokenizer.json + config."""
    from tessera.data.tokenizer import Tokenizer
    from tessera.data.tokenizer import load_tokenizer as load_data_tokenizer

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_path(path)
    if run_cfg is not None and "data" in run_cfg:
        source = (run_cfg.get("data") or {}).get("tokenizer")
        try:
            return load_data_tokenizer(source)
        except Exception:  # the bundled tokenizer may be absent from a source checkout
            return None
    return None


def eos_token_ids(path: str | Path, tokenizer) -> set[int]:
    """End-of-sequence ids: generation_config.json's and config.json's eos_token_id, and the tokenizer's."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            value = read_json_object(f).get("eos_token_id")
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
            elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                ids.update(value)
            elif value is not None:
                raise CheckpointError(f"{str(f)!r}: eos_token_id={value!r} is invalid: must be a token id or a "
                                      "list of token ids")
    if tokenizer is not None and tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return ids
