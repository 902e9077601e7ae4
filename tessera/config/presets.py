"""Named model configurations, so that nobody writes a model's shape by hand.

Each family module (tessera/config/families) lists its own: real sizes follow the published
HuggingFace `config.json` of each model; `tiny-*` ones are for tests and CPU demos.
`get_preset("mixtral-8x7b", n_layers=2)` returns a copy with overrides.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from tessera.config.errors import ConfigError
from tessera.config.families import REGISTRY
from tessera.config.model import ModelConfig

# Every preset, validated here at import.
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(family=family.name, **fields)
                                   for family in REGISTRY.values() for name, fields in family.presets.items()}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """A fresh copy of a named configuration, with top-level fields overridden."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model name {name!r}; known: {', '.join(preset_names())}")
    cfg = copy.deepcopy(PRESETS[name])
    if overrides:
        shape_changed = "dim" in overrides or "n_heads" in overrides
        if shape_changed and "head_dim" not in overrides and cfg.head_dim == cfg.dim // cfg.n_heads:
            overrides["head_dim"] = None  # derived from the new dim / n_heads
        cfg = dataclasses.replace(cfg, **overrides)
    return cfg
