"""The tokenizer a GGUF file carries (`tokenizer.ggml.*` metadata), as a Tessera `Tokenizer`.

transformers builds a fast tokenizer from that metadata (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`: vocabulary, merges, special tokens, chat template); it is saved into a temporary
directory and read back by `tessera.data.tokenizer`, the one reader of tokenizers, so a GGUF
model's tokenizer is the one `tessera convert MODEL.gguf OUT` writes beside its weights. Where
transformers' GGUF loader does not know the architecture or fails on its config (it reads the
model's config first: olmo2, seed_oss; gpt-oss's YaRN metadata), the tokenizer is built by
transformers' fast tokenizer class from the same metadata, which needs no config. Needs
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
        built = _without_config(path, e)
    with tempfile.TemporaryDirectory(prefix="tessera-gguf-tokenizer-") as tmp:
        built.save_pretrained(tmp)
        tokenizer = load_tokenizer(tmp)
    tokenizer.source = str(path)
    return tokenizer


def _without_config(path: Path, error: Exception):
    """The tokenizer of a file whose config transformers' GGUF loader cannot read (`error`), built
    from its metadata alone; ConfigError naming `error` when that fails too."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent.resolve()), gguf_file=path.name)
    except Exception:  # noqa: BLE001, S110 - the first error is the one to report
        pass
    raise ConfigError(f"{str(path)!r}: no tokenizer can be built from its GGUF metadata "
                      f"({type(error).__name__}: {error})") from None
