"""A layer of one sublayer (Nemotron-H): an RMSNorm, then a Mamba-2 mixer, attention or an MLP,
added to the residual stream, as `ModelConfig.sublayers` says per layer.

Named as a `TransformerBlock`'s halves are, so the code that reads blocks by name finds its parts: a
mixer layer has `attention_norm` and `attention` (Mamba2Mixer, or softmax attention), an MLP layer
`ffn_norm` and `feed_forward`, an MoE layer `ffn_norm` and `moe` (relu^2 experts); the other half is
absent. Its forward has the block's signature and returns the MoE layer's routing (None for the others).
Shapes: B batch, S sequence, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention import Attention
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.mlp import feed_forward
from tessera.models.moe.layer import MoE
from tessera.models.norm import RMSNorm


class SublayerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        kind = cfg.sublayers[layer_id]
        norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_unit_offset)
        if kind == "mlp":
            self.ffn_norm, self.feed_forward = norm, feed_forward(cfg.dim, cfg.ffn_dim, cfg.activation)
        elif kind == "moe":
            self.ffn_norm, self.moe = norm, MoE(cfg.dim, cfg.moe)
        else:
            self.attention_norm = norm
            self.attention = Mamba2Mixer(cfg, layer_id) if kind == "mamba" else Attention(cfg, layer_id)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                q_scale: torch.Tensor | None = None):
        if hasattr(self, "feed_forward"):
            return x_BSD + self.feed_forward(self.ffn_norm(x_BSD)), None
        if hasattr(self, "moe"):
            y_BSD, route = self.moe(self.ffn_norm(x_BSD))
            return x_BSD + y_BSD, route
        return x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, cache), None


def decoder_layer(cfg: ModelConfig, layer_id: int, block: type[nn.Module]) -> nn.Module:
    """Layer `layer_id`: a `SublayerBlock` where the model has one sublayer per layer, else `block`."""
    return SublayerBlock(cfg, layer_id) if cfg.sublayers is not None else block(cfg, layer_id)
