"""The tokenizer a GGUF file carries (`tokenizer.ggml.*` metadata), as a Tessera `Tokenizer`.

transformers builds a fast tokenizer from that metadata (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`: vocabulary, merges, special tokens, chat template); it is saved into a temporary
directory and read back by `tessera.data.tokenizer`, the one reader of tokenizers, so a GGUF
model's tokenizer is the one `tessera convert MODEL.gguf OUT` writes beside its weights. Needs
transformers (a dev/optional dependency here), imported only when a GGUF tokenizer is asked for.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tessera.checkpoint.gguf.header import read_metadata
from tessera.config.errors import ConfigError
from tessera.data.tokenizer import Tokenizer, load_tokenizer


def gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in GGUF file `path`; ConfigError when the file holds none transformers can build."""
    path = Path(path)
    read_metadata(path)  # transformers reads the file with gguf's reader: its counts are bounded first
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("reading a GGUF file's tokenizer needs the transformers package: pip install transformers "
                          "(or 'tessera[dev]')") from e
    try:
        built = AutoTokenizer.from_pretrained(str(path.parent.resolve()), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError... on a file it cannot read
        raise ConfigError(f"{str(path)!r}: no tokenizer can be built from its GGUF metadata "
                          f"({type(e).__name__}: {e})") from None
    with tempfile.TemporaryDirectory(prefix="tessera-gguf-tokenizer-") as tmp:
        built.save_pretrained(tmp)
        tokenizer = load_tokenizer(tmp)
    tokenizer.source = str(path)
    return tokenizer
