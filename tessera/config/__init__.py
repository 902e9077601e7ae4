"""Layer 1: typed configuration and errors."""

from tessera.config.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ModelError,
    ParallelError,
    TesseraError,
)
from tessera.config.model import FAMILIES, MLAConfig, ModelConfig, MoEConfig
from tessera.config.presets import get_preset, preset_names

__all__ = [
    "FAMILIES", "CheckpointError", "ConfigError", "DataError", "MLAConfig", "ModelConfig", "ModelError",
    "MoEConfig", "ParallelError", "TesseraError", "get_preset", "preset_names",
]
