"""What serving loads from a model directory: the model and its end-of-sequence ids (through the
one loader, tessera.checkpoint.loading), the tokenizer it serves with, and the engine's dtype names."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.checkpoint.loading import eos_token_ids, load_model, trained_tokenizer
from tessera.data import tokenizer as text_tokenizer

__all__ = ["eos_token_ids", "load_model", "load_tokenizer", "served_tokenizer", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def served_tokenizer(path: str | Path, run_cfg: dict | None = None) -> text_tokenizer.Tokenizer | None:
    """The tokenizer the model was trained with (`trained_tokenizer`), or None when it has none
    (then only token-id prompts work). For a Tessera checkpoint (`run_cfg`, its stored run
    configuration) a tokenizer that cannot be read is None too: the one the run named may be gone
    from this machine, or the bundled one absent from a source checkout."""
    if not run_cfg:  # a model directory: its own tokenizer.json, or none
        source = trained_tokenizer(path)
        return None if source is None else text_tokenizer.load_tokenizer(source)
    try:
        return text_tokenizer.load_tokenizer(trained_tokenizer(path))
    except Exception:
        return None


load_tokenizer = served_tokenizer  # the name engine.py imports
