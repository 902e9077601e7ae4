"""Layer 2: plain single-device model modules (attention, MLP, norms, RoPE, MoE, the decoder)."""

from tessera.config.model import MLAConfig, ModelConfig, MoEConfig
from tessera.models.transformer import ModelOutput, Transformer, TransformerBlock

__all__ = ["MLAConfig", "ModelConfig", "ModelOutput", "MoEConfig", "Transformer", "TransformerBlock"]
