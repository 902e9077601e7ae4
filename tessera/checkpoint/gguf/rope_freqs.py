"""Llama 3's RoPE scaling from a GGUF file's `rope_freqs` tensor.

llama.cpp's converter does not write Llama 3's `rope_scaling` (factor, low / high frequency
factors, original context) as metadata: it writes the table those give, one divisor per rotary
pair (`rope_freqs.weight`): 1 for wavelengths below original / high, `factor` above original /
low, and 1 / ((1 - s) / factor + s) between, with s = (original / wavelength - low) / (high - low).
Only the two wavelength bounds matter, so the scaling is read back with low = 1: `factor` is the
table's largest value, and the pairs between the bounds (s is linear in 1 / wavelength) give
original and high. The scaling found is checked to give the file's table again; a table that is
not a Llama 3 one is refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tessera.config.errors import ConfigError


def llama3_table(scaling: dict[str, Any], head_dim: int, theta: float) -> torch.Tensor:
    """The divisor of each rotary pair that Llama 3 `scaling` gives (llama.cpp's `rope_freqs`)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, mid))


def _bounds(wavelen: torch.Tensor, s: torch.Tensor, between: torch.Tensor) -> tuple[float, float]:
    """(original context, high frequency factor) with low = 1, from the pairs between the bounds."""
    if int(between.sum()) >= 2:  # s = A / wavelength + B: original = -A / B, high = 1 - 1 / B
        x = torch.stack([1 / wavelen[between], torch.ones_like(s[between])], dim=1)
        a, b = torch.linalg.lstsq(x, s[between].unsqueeze(1)).solution.flatten().tolist()
        return round(-a / b), round(1 - 1 / b, 4)
    # no pair between: any bounds in the gap between the last unscaled and the first scaled pair
    first = int(torch.nonzero(~(s >= 1)).min())
    short, long = float(wavelen[first - 1]) if first else 0.0, float(wavelen[first])
    high_wl = (short + long) / 2
    old = (high_wl + long) / 2
    return old, old / high_wl


def llama3_from_rope_freqs(path, factors: list[float], head_dim: int, theta: float) -> dict[str, Any] | None:
    """HuggingFace's Llama 3 `rope_scaling` whose table is `factors` (None when every divisor is 1)."""
    table = torch.tensor(factors, dtype=torch.float64)
    if table.numel() != head_dim // 2 or not bool(torch.isfinite(table).all()) or bool((table < 1 - 1e-6).any()):
        raise ConfigError(f"{str(path)!r}: tensor 'rope_freqs' holds {table.numel()} divisors; Tessera reads "
                          f"Llama 3's table of {head_dim // 2} (one per rotary pair), each >= 1")
    factor = round(float(table.max()), 6)
    if factor <= 1 + 1e-6:
        return None
    wavelen = 2 * math.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    s = (1 / table - 1 / factor) / (1 - 1 / factor)  # 1 unscaled, 0 scaled by `factor`
    between = (s < 1 - 1e-6) & (s > 1e-6)
    old, high = _bounds(wavelen, s, between)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
               "original_max_position_embeddings": old}
    if high <= 1 or old <= 0 or not torch.allclose(llama3_table(scaling, head_dim, theta), table, rtol=1e-4):
        raise ConfigError(f"{str(path)!r}: tensor 'rope_freqs' is not a Llama 3 RoPE scaling table (1 for short "
                          "wavelengths, one factor for long ones, smooth between), the only one Tessera reads")
    return scaling
