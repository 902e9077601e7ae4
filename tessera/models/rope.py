"""Rotary position embedding (Su et al. 2021, RoFormer) and its context-extension variants.

Frequencies: theta_j = base^(-2j/d). Variants, selected by `rope_scaling["rope_type"]`:
- "linear": positions divided by `factor` (Chen et al. 2023, position interpolation);
- "llama3": low frequencies divided by `factor`, high ones kept, a smooth ramp between
  (Meta, LLaMA 3.1 report);
- "yarn": NTK-by-parts interpolation plus an attention temperature (Peng et al. 2023, YaRN,
  arXiv 2309.00071), as DeepSeek-V2/V3 use;
- "longrope": each frequency divided by its own searched factor, one table (`short_factor`) for
  sequences within `original_max_position_embeddings` and another (`long_factor`) beyond, with an
  attention temperature sqrt(1 + ln(factor) / ln(original)) (Ding et al. 2024, LongRoPE, arXiv
  2402.13753; Phi-3 / Phi-4). Which table a call uses depends on its longest sequence, so it is a
  seam of its own: `rope_frequencies` gives the short table, `longrope_long_frequencies` the long
  one, and `longrope_pick` chooses per call on the device (as transformers does: the whole call by
  its largest position).

Rotation uses the "half" layout: the pair (x[j], x[j + d/2]) is rotated by angle p * theta_j.
Partial rotary (GLM-4.5's `partial_rotary_factor`): tables narrower than the head rotate its first
dimensions only, the rest pass unchanged (`apply_rope` reads the width from the tables).
Shapes: B batch, S sequence, H heads, D rotary dimension.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, base: float, scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] in fp32 and the factor applied to cos/sin (1 unless YaRN)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_len = float(scaling["original_max_position_embeddings"])
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                    if mscale and mscale_all else _yarn_mscale(factor))
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1 = keep the original frequency (high frequencies)
        inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        return inv_freq, float(attn)
    if kind == "longrope":
        return _longrope(dim, base, scaling, "short_factor")
    raise ValueError(f"unknown rope_type {kind!r}")


def _longrope(dim: int, base: float, scaling: dict[str, Any], table: str) -> tuple[torch.Tensor, float]:
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(scaling[table], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attn)


def longrope_long_frequencies(dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor | None:
    """LongRoPE's table for sequences longer than `original_max_position_embeddings` (None for any
    other kind of RoPE, which has one table)."""
    if (scaling or {}).get("rope_type", (scaling or {}).get("type")) != "longrope":
        return None
    return _longrope(dim, base, scaling, "long_factor")[0]


def longrope_pick(positions: torch.Tensor, short: torch.Tensor, long: torch.Tensor, original: int) -> torch.Tensor:
    """The table a call rotates by: the long one when its largest position is at or past `original`,
    chosen on the device (no host sync)."""
    return torch.where(positions.max() + 1 > original, long.to(positions.device), short.to(positions.device))


def yarn_softmax_scale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's extra softmax scale under YaRN: mscale(factor, mscale_all_dim)^2 (1 otherwise)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    m = scaling.get("mscale_all_dim") or 0
    return _yarn_mscale(float(scaling["factor"]), m) ** 2 if m else 1.0


def interleaved_sections(freqs_3: torch.Tensor, sections: list[int]) -> torch.Tensor:
    """Qwen3-VL's and Qwen3.5's M-RoPE layout of the angles [3, ..., D/2]: pair j takes coordinate
    j mod 3 (temporal, height, width in turn) while that coordinate's count in `sections` lasts,
    the temporal coordinate after that."""
    freqs = freqs_3[0].clone()
    for axis in (1, 2):
        picked = slice(axis, sections[axis] * 3, 3)
        freqs[..., picked] = freqs_3[axis][..., picked]
    return freqs


def rope_cos_sin(positions_BS: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
                 dtype: torch.dtype, sections: list[int] | None = None,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, S, D] (the D/2 angles repeated twice), computed in fp32.

    Multimodal RoPE (Qwen2-VL's M-RoPE): positions [3, B, S] give each token a (temporal, height,
    width) position, and `sections` (three counts summing to D/2) splits the frequency pairs into
    three consecutive groups, each rotated by its own coordinate; `interleaved` (Qwen3-VL, Qwen3.5)
    deals the pairs to the coordinates in turn instead (`interleaved_sections`). A text token has
    all three equal, where either is plain RoPE."""
    if positions_BS.dim() == 3:
        if sections is None or positions_BS.shape[0] != len(sections):
            raise ValueError(f"3-D rotary positions {list(positions_BS.shape)} need an mrope_section of as many "
                             f"groups; got {sections!r}")
        freqs_3 = positions_BS.float()[..., None] * inv_freq.to(positions_BS.device)
        freqs = (interleaved_sections(freqs_3, sections) if interleaved else
                 torch.cat([part[i] for i, part in enumerate(freqs_3.split(sections, dim=-1))], dim=-1))
    else:
        freqs = positions_BS.float()[..., None] * inv_freq.to(positions_BS.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate x. interleaved=True takes pairs (x[2j], x[2j+1]) (DeepSeek's layout) and returns them
    de-interleaved (evens then odds); q and k get the same permutation, so q.k is unchanged. Tables
    narrower than x rotate its first dims only and pass the rest (partial rotary: GLM-4.5, Qwen3-Next)."""
    rotated = cos_BSD.shape[-1]
    if rotated < x_BSHD.shape[-1]:
        head, tail = x_BSHD[..., :rotated], x_BSHD[..., rotated:]
        return torch.cat([apply_rope(head, cos_BSD, sin_BSD, interleaved), tail], dim=-1)
    if interleaved:
        x_BSHD = torch.cat((x_BSHD[..., 0::2], x_BSHD[..., 1::2]), dim=-1)
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)
    return x_BSHD * cos + rotate_half(x_BSHD) * sin
