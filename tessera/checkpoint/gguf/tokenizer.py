"""The tokenizer a GGUF file carries (`tokenizer.ggml.*` metadata), as a Tessera `Tokenizer`.

transformers builds a fast tokenizer from that metadata (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`: vocabulary, merges, special tokens, chat template); it is saved into a temporary
directory and read back by `tessera.data.tokenizer`, the one reader of tokenizers, so a GGUF
model's tokenizer is the one `tessera convert MODEL.gguf OUT` writes beside its weights. Where
transformers' GGUF loader does not know the architecture or fails on its config (it reads the
model's config first: olmo2, seed_oss; gpt-oss's YaRN metadata), the tokenizer is built by
transformers' fast tokenizer class from the same metadata, which needs no config. Needs
transformers (a dev/optional dependency here).

The building runs in a child process (`python -m tessera.checkpoint.gguf.tokenizer FILE DIR`):
transformers' GGUF path imports its model configurations, torch._dynamo, DTensor and sympy, about
120 MiB that a server would otherwise hold for its whole life for one call at start-up (issue 53:
`tessera serve MODEL.gguf` against llama.cpp's server). The child writes the tokenizer's files; this
process reads them with `tokenizers` alone. A process that has imported transformers already builds
it itself (nothing is left to save, and a child would only add its start-up). A file the child
cannot build from is refused as before (ConfigError, its one-line message).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tessera.checkpoint.gguf.header import read_metadata
from tessera.config.errors import ConfigError
from tessera.data.tokenizer import Tokenizer, load_tokenizer

NO_TRANSFORMERS = ("reading a GGUF file's tokenizer needs the transformers package: pip install transformers "
                   "(or 'tessera[dev]')")
BUILD_TIMEOUT_S = 600  # a hang bound for the child (it reads metadata and builds a vocabulary)


def gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in GGUF file `path`; ConfigError when the file holds none transformers can build."""
    path = Path(path)
    read_metadata(path)  # transformers reads the file with gguf's reader: its counts are bounded first
    if not _has_transformers():
        raise ConfigError(NO_TRANSFORMERS)
    with tempfile.TemporaryDirectory(prefix="tessera-gguf-tokenizer-") as tmp:
        if sys.modules.get("transformers") is not None:  # imported already (a notebook, a test): no memory to save
            save_gguf_tokenizer(path, tmp)
        else:
            _build_in_child(path, Path(tmp))
        tokenizer = load_tokenizer(tmp)
    tokenizer.source = str(path)
    return tokenizer


def _has_transformers() -> bool:
    try:
        hidden = sys.modules.get("transformers", True) is None  # `import transformers` would raise
        return not hidden and importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def _build_in_child(path: Path, out: Path) -> None:
    """Run `save_gguf_tokenizer(path, out)` in a child Python (module docstring); its ConfigError here."""
    package_root = str(Path(__file__).resolve().parents[3])  # this tessera, whatever the child's sys.path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "tessera.checkpoint.gguf.tokenizer", str(path), str(out)],
                         env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {run.returncode}"
        raise ConfigError(reason.removeprefix("tessera.config.errors.ConfigError: "))


def save_gguf_tokenizer(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Build the tokenizer of GGUF file `path` with transformers and save its files into directory `out`."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(NO_TRANSFORMERS) from e
    try:
        built = AutoTokenizer.from_pretrained(str(path.parent.resolve()), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError... on a file it cannot read
        built = _without_config(path, e)
    built.save_pretrained(str(out))


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


if __name__ == "__main__":  # the child process of `_build_in_child`
    try:
        save_gguf_tokenizer(sys.argv[1], sys.argv[2])
    except ConfigError as e:
        print(" ".join(str(e).split()), file=sys.stderr)  # one line: the parent raises it as it is
        sys.exit(2)
