"""EXAONE 4 (Exaone4ForCausalLM): OLMo 2's blocks (RMSNorms after attention and after the MLP, none
before them) with Qwen3's QK norm (per head, before RoPE). With a `sliding_window` its layers are
hybrid: those `layer_types` calls "sliding_attention" (three of every four, `sliding_window_pattern`)
attend within the window and rotate by RoPE, the "full_attention" ones see every position without
any positional encoding (Tessera's `model.window_layers` and `model.nope_layers`, one the other's
complement); without one every layer is full and rotated. One RoPE (`rope_theta`, `rope_scaling`)
for every rotated layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ConfigError, ModelError
from tessera.config.families.base import Family

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types_from_hf(d: Mapping[str, Any]) -> list[str]:
    """Each layer's type as transformers' Exaone4Config reads them: `layer_types`, else every
    `sliding_window_pattern`-th layer full (an integer, or a string such as "LLLG": L local, G global)."""
    n_layers, types = d["num_hidden_layers"], d.get("layer_types")
    if types is None:
        if d.get("sliding_window") is None:
            return [FULL] * n_layers
        pattern = d.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n_layers)]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"sliding_window_pattern={pattern!r} is invalid: must be an integer >= 1 or a string "
                              "of L (local) and G (global)")
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) < n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"layer_types={types!r} is invalid: must list {SLIDING!r} or {FULL!r} for each of the "
                          f"{n_layers} layers")
    return list(types[:n_layers])


@dataclass(frozen=True)
class Exaone4(Family):
    nope: ClassVar[bool] = True
    layer_windows: ClassVar[bool] = True

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)
        types = layer_types_from_hf(d)
        if d.get("sliding_window") is not None:  # hybrid: the full layers are the NoPE ones
            fields.update(sliding_window=d["sliding_window"],
                          window_layers=[i for i, t in enumerate(types) if t == SLIDING],
                          nope_layers=[i for i, t in enumerate(types) if t == FULL])
        return fields

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        windowed = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is not None]
        full = [i for i in range(cfg.n_layers) if i not in windowed]
        hybrid = cfg.sliding_window is not None
        if cfg.local_rope_theta is not None:
            raise ModelError(f"exaone4 rotates every layer by one RoPE (model.local_rope_theta="
                             f"{cfg.local_rope_theta}); export it as olmo3")
        if sorted(cfg.nope_layers) != (full if hybrid else []):
            raise ModelError(f"exaone4's layers without RoPE are exactly its full-attention ones when it has a "
                             f"sliding window, and none without one (model.nope_layers={cfg.nope_layers}, "
                             f"full-attention layers {full if hybrid else 'all'})")
        super().attention_to_hf(cfg.__class__(**{**cfg.to_dict(), "sliding_window": None, "window_layers": None,
                                                 "nope_layers": []}), d)
        d.pop("attention_bias", None)  # EXAONE 4's projections have no biases (checked below)
        if cfg.qkv_bias or cfg.out_bias:
            raise ModelError("exaone4's attention has no biases (model.qkv_bias and model.out_bias must be false)")
        d.update(sliding_window=cfg.sliding_window,
                 layer_types=[SLIDING if hybrid and i in windowed else FULL for i in range(cfg.n_layers)])


_LLAMA3_X16 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
_EXAONE4 = dict(vocab_size=102400, norm_eps=1e-5, rope_theta=1e6, rope_scaling=_LLAMA3_X16, block_norms="post",
                qk_norm=True)
FAMILY = Exaone4(name="exaone4", architecture="Exaone4ForCausalLM", qk_norm=True, block_norms="post",
                 int_fields=("sliding_window",), presets={
    # LGAI-EXAONE/EXAONE-4.0-1.2B: every layer full and rotated, tied embeddings
    "exaone4-1.2b": dict(dim=2048, n_layers=30, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=4096,
                         max_seq_len=65536, tie_embeddings=True, **_EXAONE4),
    # LGAI-EXAONE/EXAONE-4.0-32B: three sliding layers (window 4096, RoPE) to one global layer without RoPE
    "exaone4-32b": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=27392,
                        max_seq_len=131072, sliding_window=4096, window_layers=[i for i in range(64) if (i + 1) % 4],
                        nope_layers=[i for i in range(64) if (i + 1) % 4 == 0], **_EXAONE4),
})
