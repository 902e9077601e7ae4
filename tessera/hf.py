"""HuggingFace interop: `load_pretrained(dir, dtype=...)` and `save_pretrained(model, dir)`.

The implementation lives in `tessera.checkpoint.hf`; this module is the public front door.
"""

from tessera.checkpoint.hf import load_pretrained, save_pretrained
from tessera.config.hf_config import SUPPORTED, config_from_hf, config_to_hf, read_hf_config

__all__ = ["SUPPORTED", "config_from_hf", "config_to_hf", "load_pretrained", "read_hf_config", "save_pretrained"]
