"""HuggingFace interop: `load_pretrained(dir, dtype=...)` and `save_pretrained(model, dir)`.

The implementation lives in `tessera.checkpoint.hf` (load.py, writer.py) and, for config.json,
`tessera.config.hf_config`; this module is the public front door.
"""

from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.writer import save_pretrained
from tessera.config.hf_config import SUPPORTED, config_from_hf, config_to_hf, read_hf_config

__all__ = ["SUPPORTED", "config_from_hf", "config_to_hf", "load_pretrained", "read_hf_config", "save_pretrained"]
