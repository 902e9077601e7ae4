"""The native-resolution vision transformer of Qwen2-VL and Qwen2.5-VL (Wang et al. 2024, "Qwen2-VL";
Bai et al. 2025, "Qwen2.5-VL Technical Report").

An image of any size (a multiple of patch_size x spatial_merge_size a side, what the image
processor makes) arrives as its patches, one row of `pixel_values` each, and its patch grid
(t, h, w) in `grid_thw`. The patches come block-major: the merge x merge patches that become one
language-model token are consecutive rows. Each patch is embedded by a Conv3d over
(temporal_patch_size, patch_size, patch_size); there is no position table: every block rotates q
and k by the patch's row (the first half of each head's rotary pairs) and column (the second
half), 2-D RoPE in the "half" layout. Attention is bidirectional
within one image frame; Qwen2.5-VL's blocks other than `fullatt_blocks` attend only within
windows of window_size pixels a side (its tokens are reordered window by window, in units of
merge blocks, before the first block and the merged outputs restored to the image's order after).
The merger normalises each patch, concatenates each merge block's patches and maps them through
a two-layer GELU MLP into the language model's width.

Qwen3-VL's tower (Qwen3.5's, tessera/models/vision/qwen3_vision.py) is this one with learned
positions added to the patches: `embed_patches` is where they go.

A plain single-device module, no collectives. Shapes: P patches (all images together), D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.errors import ModelError
from tessera.config.qwen_vl import QwenVisionConfig
from tessera.models.norm import RMSNorm
from tessera.models.rope import rotate_half
from tessera.models.vision.vision_tower import activation

NORM_EPS = 1e-6  # every norm of both towers


def vision_act(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if name == "silu" else activation(name, x)


def _norm(cfg: QwenVisionConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=NORM_EPS) if cfg.layer_norm else RMSNorm(dim, NORM_EPS)


def check_grids(grid_thw: torch.Tensor, patches: int, cfg: QwenVisionConfig) -> list[tuple[int, int, int]]:
    """`grid_thw` [N, 3] as a list of (t, h, w), checked against the patch rows and the merge size."""
    if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
        raise ModelError(f"image_grid_thw must be [N, 3] (t, h, w patches per image); got {list(grid_thw.shape)}")
    grids = [tuple(int(x) for x in row) for row in grid_thw.tolist()]
    m = cfg.spatial_merge_size
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ModelError(f"image grid (t={t}, h={h}, w={w}) is invalid: positive, h and w multiples of "
                             f"spatial_merge_size={m}")
    if sum(t * h * w for t, h, w in grids) != patches:
        raise ModelError(f"pixel_values has {patches} patch rows but image_grid_thw {grids} describes "
                         f"{sum(t * h * w for t, h, w in grids)}")
    return grids


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of every patch, in the block-major order of the pixel rows."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [block row, row in block, block col, col in block] -> block-major
        hw = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def frame_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """Patches of each attention segment of full attention: one image frame each."""
    return [h * w for t, h, w in grids for _ in range(t)]


def window_order(grids: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows of `side` merged tokens a side: the merge blocks' order window by window
    (each frame's windows row-major, a window's blocks row-major), and each window's patch count."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        H, W = h // merge, w // merge
        idx = torch.arange(t * H * W).view(t, H, W) + base
        for f in range(t):
            for r in range(0, H, side):
                for c in range(0, W, side):
                    block = idx[f, r:r + side, c:c + side].reshape(-1)
                    order.append(block)
                    lengths.append(block.numel() * merge * merge)
        base += t * H * W
    return torch.cat(order), lengths


class QwenVisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x_PD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        P = x_PD.shape[0]
        q, k, v = self.wqkv(x_PD).view(P, 3, self.n_heads, self.head_dim).unbind(1)  # [P, heads, d]
        c, s = cos[:, None], sin[:, None]  # rotated in fp32, as the reference does
        q = (q.float() * c + rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(v.dtype)
        outs = []
        for qs, ks, vs in zip(*(t.transpose(0, 1).split(lengths, dim=1) for t in (q, k, v)), strict=True):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5))  # [heads, L, d]
        return self.wo(torch.cat(outs, dim=1).transpose(0, 1).reshape(P, -1))


class QwenVisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1 x)); Qwen2.5-VL: w2(act(w1 x) * w3 x), every linear with a bias."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.act, self.gated = cfg.act, cfg.gated_mlp
        if self.gated:
            self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim)
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim)
            self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim)
        else:
            self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
            self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(vision_act(self.act, self.w1(x)) * self.w3(x))
        return self.fc2(vision_act(self.act, self.fc1(x)))


class QwenVisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.norm1 = _norm(cfg, cfg.dim)
        self.attention = QwenVisionAttention(cfg)
        self.norm2 = _norm(cfg, cfg.dim)
        self.mlp = QwenVisionMLP(cfg)

    def forward(self, x_PD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x_PD = x_PD + self.attention(self.norm1(x_PD), cos, sin, lengths)
        return x_PD + self.mlp(self.norm2(x_PD))


class PatchMerger(nn.Module):
    """Each merge x merge block of normed patches, concatenated, through linear -> GELU -> linear."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        width = cfg.dim * cfg.spatial_merge_size**2
        self.norm = _norm(cfg, cfg.dim)
        self.linear_1 = nn.Linear(width, width)
        self.linear_2 = nn.Linear(width, cfg.out_dim)
        self.width = width

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.norm(x_PD).view(-1, self.width))))


class QwenVisionTransformer(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.cfg = cfg
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.patch_embed = nn.Conv3d(cfg.in_channels, cfg.dim, kernel_size=(t, p, p), stride=(t, p, p), bias=False)
        self.layers = nn.ModuleDict({str(i): QwenVisionBlock(cfg) for i in range(cfg.n_layers)})
        self.merger = PatchMerger(cfg)

    def embed_patches(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, dim]: each patch row through the patch embedding (Qwen3-VL's kind adds its learned
        positions here: tessera/models/vision/qwen3_vision.py)."""
        cfg, w = self.cfg, self.patch_embed.weight
        return self.patch_embed(pixel_values.to(w.dtype).view(-1, cfg.in_channels, cfg.temporal_patch_size,
                                                              cfg.patch_size, cfg.patch_size)).view(-1, cfg.dim)

    def rotary(self, positions_P2: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [P, head_dim]: rows rotate the first half of the pairs, columns the second."""
        quarter = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device)
                                                  / quarter))
        angles = (positions_P2.to(device).float()[..., None] * inv_freq).flatten(1)  # [P, (row, col) x pairs]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One [t x h x w / merge^2, out_dim] tensor per image: its language-model input rows."""
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_values:
            raise ModelError(f"pixel_values must be [patches, {cfg.patch_values}] (channels x temporal_patch_size x "
                             f"patch_size^2 values a row, from the image processor); got {list(pixel_values.shape)}")
        grids = check_grids(grid_thw, pixel_values.shape[0], cfg)
        m, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        x = self.embed_patches(pixel_values, grids)
        cos, sin = self.rotary(patch_positions(grids, m), x.device)
        full = frame_lengths(grids)
        order, windowed = None, full
        if cfg.version == "qwen2_5_vl":
            order, windowed = window_order(grids, m, cfg.window_size // m // cfg.patch_size)
            x, cos, sin = (t.view(-1, unit, t.shape[-1])[order.to(t.device)].view(-1, t.shape[-1])
                           for t in (x, cos, sin))
        for key, block in self.layers.items():
            x = block(x, cos, sin, full if int(key) in cfg.fullatt_blocks or order is None else windowed)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order).to(merged.device)]
        return list(merged.split([t * h * w // unit for t, h, w in grids]))
