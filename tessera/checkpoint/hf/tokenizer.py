"""The tokenizer half of a HuggingFace export: tokenizer files, special-token ids, chat template.

A model directory is only usable with the tokenizer it was trained with: `transformers` loads it
with `AutoTokenizer`, `generate` stops at `eos_token_id` (without one it assumes id 2, which in
the bundled vocabulary is `<|system|>`), and `tessera serve` needs it to read text prompts. An
export therefore writes `tokenizer.json` and `tokenizer_config.json` (special tokens and the chat
template, `tessera.data.tokenizer.Tokenizer.save`), puts `bos_token_id` / `eos_token_id` /
`pad_token_id` in config.json, and writes them again in `generation_config.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tessera.config.errors import CheckpointError
from tessera.data.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_tokenizer(tokenizer: Tokenizer | str | os.PathLike | None) -> Tokenizer | None:
    """A `Tokenizer` from an object, a path, "default" (the bundled one), or None (no tokenizer)."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    return load_tokenizer(tokenizer)


def special_token_ids(tokenizer: Tokenizer | None) -> dict[str, int | None]:
    """`bos_token_id`, `eos_token_id`, `pad_token_id` as config.json spells them (None when absent)."""
    if tokenizer is None:
        return {}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> None:
    """A tokenizer whose ids do not all fit the embedding would fail on the first such token."""
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer.source or ''} has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {vocab_size}; export with the tokenizer the model was trained with")


def write_tokenizer_files(directory: Path, tokenizer: Tokenizer | None) -> None:
    """Tokenizer files and generation_config.json into `directory` (when there is a tokenizer)."""
    if tokenizer is None:
        return
    tokenizer.save(directory)
    generation = {k: v for k, v in special_token_ids(tokenizer).items() if v is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
