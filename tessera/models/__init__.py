"""Layer 2: plain single-device model modules (attention, MLP, norms, RoPE, MoE, the decoder), and
the parameter and FLOP counts of a `ModelConfig` (`counting.py`, `flops.py`).

The torch modules load on first use (`from tessera.models import Transformer` works as usual), so
that importing the counts, which are pure arithmetic, does not import torch: the planner uses them
and stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tessera.config.model import MLAConfig, ModelConfig, MoEConfig

if TYPE_CHECKING:
    from tessera.models.model_input import ModelInput
    from tessera.models.transformer import ModelOutput, Transformer, TransformerBlock

_LAZY = {"ModelInput": "tessera.models.model_input", "ModelOutput": "tessera.models.transformer",
         "Transformer": "tessera.models.transformer", "TransformerBlock": "tessera.models.transformer"}

__all__ = ["MLAConfig", "ModelConfig", "ModelInput", "ModelOutput", "MoEConfig", "Transformer", "TransformerBlock"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
