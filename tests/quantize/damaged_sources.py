"""A copy of a HuggingFace model directory with one weight made non-finite (a NaN, an infinity), the
damaged source `tessera quantize` and `tessera prune` must refuse by name before any work."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def with_nonfinite_weight(src: Path, dst: Path, key: str, value: float) -> Path:
    """`dst`, a copy of `src` whose tensor `key` has `value` at its first element."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    weights = load_file(path)
    weights[key].view(-1)[0] = value
    save_file(weights, path, metadata={"format": "pt"})
    return dst
