"""Qwen3.5 and Qwen3.5-MoE (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`):
Qwen3-VL's vision tower before a Qwen3.5 hybrid language model (tessera/config/families/hybrid).

The tower is Qwen2-VL's (tessera/models/vision/qwen_vision.py: Conv3d patches in block-major order,
2-D rotary positions, full attention within each frame, LayerNorm, a fc1/fc2 MLP, the 2x2 merger)
with what Qwen3-VL changed, each where the shared tower leaves a seam:

- the patch embedding has a bias, and each patch adds a learned position: a side x side table
  (`position_embeddings` entries) resampled bilinearly (corners aligned) to the image's h x w patch
  grid, in the patches' block-major order, the same for every frame (`embed_patches`);
- the language model's M-RoPE deals its rotary pairs to (temporal, height, width) in turn
  (`mrope_interleaved`, tessera/models/rope.py) rather than in three consecutive groups.

The prompt's 3-D positions are Qwen2-VL's (`mrope_positions`). Qwen3-VL's deepstack (features of
early tower blocks added to the first text layers' hidden states) is not Qwen3.5's: its tower has
one merger and its language model takes the images only at the placeholders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.qwen_vl import QwenVisionConfig
from tessera.models.vision.qwen_vision import QwenVisionTransformer
from tessera.models.vision.qwen_vl import QwenVL


def resampled_positions(table_ND: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[P, D]: the learned position table (a side x side grid, row-major) resampled to each image's
    (h, w) patch grid by bilinear interpolation with aligned corners, block-major as the patch rows
    come, repeated for each of its t frames."""
    side = int(round(table_ND.shape[0] ** 0.5))
    grid = table_ND.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, D, side, side]
    out = []
    for t, h, w in grids:
        hw = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
        blocks = hw.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)  # [H, W, m, m, D]
        out.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out)


class Qwen3VisionTransformer(QwenVisionTransformer):
    """Qwen3-VL's tower (module docstring): Qwen2-VL's with a biased patch embedding and learned positions."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__(cfg)
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.patch_embed = nn.Conv3d(cfg.in_channels, cfg.dim, kernel_size=(t, p, p), stride=(t, p, p), bias=True)
        self.pos_embed = nn.Embedding(cfg.position_embeddings, cfg.dim)

    def embed_patches(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = super().embed_patches(pixel_values, grids)
        return x + resampled_positions(self.pos_embed.weight, grids, self.cfg.spatial_merge_size).to(x.dtype)


class Qwen35VL(QwenVL):
    """Qwen3.5 / Qwen3.5-MoE with their images (module docstring); the rest is QwenVL's."""

    tower = Qwen3VisionTransformer

    def part_modules(self, part: str) -> list[nn.Module]:
        """As QwenVL's, the learned position table with the tower."""
        tower = self.vision_tower
        if part == "vision_tower":
            return [tower.patch_embed, tower.pos_embed, tower.layers]
        return super().part_modules(part)
