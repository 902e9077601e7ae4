"""Layer 1: typed configuration and errors."""

from tessera.config.errors import CheckpointError, ConfigError, DataError, ModelError, ParallelError, TesseraError
from tessera.config.model import FAMILIES, MLAConfig, ModelConfig, MoEConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.presets import get_preset, preset_names
from tessera.config.schema import RunConfig, load_config

__all__ = [
    "FAMILIES", "CheckpointError", "ConfigError", "DataError", "MLAConfig", "ModelConfig", "ModelError",
    "MoEConfig", "ParallelConfig", "ParallelError", "RunConfig", "TesseraError", "get_preset", "load_config",
    "preset_names",
]
