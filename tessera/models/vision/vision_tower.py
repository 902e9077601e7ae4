"""The vision tower: a ViT image encoder (Dosovitskiy et al. 2021), as CLIP and SigLIP define it.

Pixels [N, C, H, W] are cut into patches by a strided convolution, each patch a token, plus a
learned class token in front (CLIP); a learned position table is added (the image must have the
size it was trained for: no interpolation). Pre-norm blocks of bidirectional multi-head attention
and a two-layer MLP follow; CLIP puts a LayerNorm before the first block. The tower returns the
hidden states a caller asks for by index: 0 is the first block's input, i the output of block i
(transformers' `hidden_states` tuple), so LLaVA's `vision_feature_layer` reads the same values.
SigLIP's attention-pooling head is held (its weights travel through import and export) but never
run: a vision-language model reads token features, not the pooled one.

A plain single-device module, no collectives. Shapes: N images, T tokens, D width, P patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.errors import ModelError
from tessera.config.vision import VisionConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations of transformers' ACT2FN that these towers and LLaVA's projector use."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x_NTD: torch.Tensor) -> torch.Tensor:
        N, T, _ = x_NTD.shape
        q, k, v = (w(x_NTD).view(N, T, self.n_heads, self.head_dim).transpose(1, 2)  # [N, heads, T, d]
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every token sees every token
        return self.wo(out.transpose(1, 2).reshape(N, T, self.n_heads * self.head_dim))  # N may be 0


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = cfg.act
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x_NTD: torch.Tensor) -> torch.Tensor:
        x_NTD = x_NTD + self.attention(self.norm1(x_NTD))
        return x_NTD + self.mlp(self.norm2(x_NTD))


class AttentionPoolingHead(nn.Module):
    """SigLIP's pooling head (a probe attending over the tokens, then an MLP): weights only here."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.attention = nn.MultiheadAttention(cfg.dim, cfg.n_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg)
        self.requires_grad_(False)  # never run by a vision-language model, so never trained


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.dim, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=cfg.kind == "siglip")
        self.class_embedding = nn.Parameter(torch.zeros(cfg.dim)) if cfg.kind == "clip" else None
        self.position_embedding = nn.Embedding(cfg.tokens, cfg.dim)
        self.pre_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) if cfg.kind == "clip" else None
        self.layers = nn.ModuleDict({str(i): VisionBlock(cfg) for i in range(cfg.n_layers)})
        self.post_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)  # after the last block; LLaVA reads before it
        self.head = AttentionPoolingHead(cfg) if cfg.use_head else None

    def embed(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        """Patch tokens (with CLIP's class token first) plus positions, [N, T, D]."""
        size = self.cfg.image_size
        if pixels_NCHW.dim() != 4 or tuple(pixels_NCHW.shape[1:]) != (self.cfg.num_channels, size, size):
            raise ModelError(f"the vision tower takes pixel values [N, {self.cfg.num_channels}, {size}, {size}]; got "
                             f"{list(pixels_NCHW.shape)} (the image processor resizes images to that size)")
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels_NCHW.to(w.dtype)).flatten(2).transpose(1, 2)  # [N, D, h, w] -> [N, P, D]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        return self.pre_norm(x) if self.pre_norm is not None else x

    def forward(self, pixels_NCHW: torch.Tensor, hidden_layers: list[int]) -> list[torch.Tensor]:
        """The hidden states [N, T, D] at `hidden_layers` (0: the first block's input, i: block i's
        output), in that order; blocks past the deepest one asked for are not run."""
        wanted = {i: None for i in hidden_layers}
        h = self.embed(pixels_NCHW)
        if 0 in wanted:
            wanted[0] = h
        for key, block in self.layers.items():
            if int(key) >= max(wanted):
                break
            h = block(h)
            if int(key) + 1 in wanted:
                wanted[int(key) + 1] = h
        return [wanted[i] for i in hidden_layers]
