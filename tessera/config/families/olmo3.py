"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's decoder (norms after attention and MLP, QK norm over all
heads) with a sliding window on the layers config.json's `layer_types` calls "sliding_attention"
(three of every four by default), `model.window_layers` here. transformers 5 gives each layer type
its own RoPE (`rope_parameters` keyed by type; a legacy `rope_scaling` applies to the full layers
only): the full layers' is `rope_theta` / `rope_scaling`, the sliding layers' an unscaled base,
`model.local_rope_theta` when it differs; a sliding layer with scaled RoPE is refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ConfigError, ModelError
from tessera.config.families.base import Family, rope_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta


def layer_ropes(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(full layers' theta, their scaling, sliding layers' theta), as transformers reads config.json."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, sliding = params.get(FULL) or {}, params.get(SLIDING) or {}
        theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": DEFAULT_THETA, **full}})
        local, local_scaling = rope_from_hf({"rope_parameters": {"rope_theta": DEFAULT_THETA, **sliding}})
        if local_scaling is not None:
            raise ModelError(f"rope_parameters.{SLIDING}={sliding} is not supported: Tessera's sliding layers "
                             "rotate by unscaled RoPE")
        return theta, scaling, local
    # legacy keys: rope_scaling on the full layers; rope_theta read for the full layers, after which
    # transformers gives the sliding layers the class default
    theta, scaling = rope_from_hf({"rope_theta": DEFAULT_THETA, **d})
    return theta, scaling, DEFAULT_THETA if "rope_theta" in d else theta


def window_fields(d: Mapping[str, Any], period: int,
                  ropes: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None, float]]) -> dict[str, Any]:
    """The RoPE and windows of a model whose `layer_types` mark its sliding and full layers (every
    `period`-th layer full when config.json lists none; OLMo 3, Gemma 3): rope_theta and
    rope_scaling, and where some layers slide their window, those layers and their own RoPE base
    (`ropes`: the family's (full theta, scaling, sliding theta) from config.json)."""
    n_layers = d["num_hidden_layers"]
    types = d.get("layer_types") or [SLIDING if (i + 1) % period else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) < n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"layer_types={types!r} is invalid: must list {SLIDING!r} or {FULL!r} for each of the "
                          f"{n_layers} layers")
    sliding = [i for i in range(n_layers) if types[i] == SLIDING]
    theta, scaling, local = ropes(d)
    fields: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    if sliding:
        fields.update(sliding_window=d.get("sliding_window") or 4096, window_layers=sliding,
                      local_rope_theta=None if local == theta and scaling is None else local)
    return fields


@dataclass(frozen=True)
class Olmo3(Family):
    layer_windows: ClassVar[bool] = True

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return super().attention_from_hf(d) | window_fields(d, 4, layer_ropes)

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        windowed = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is not None]
        if cfg.sliding_window is not None and cfg.window_layers is None:
            raise ModelError("olmo3 keeps some layers without a window: give model.window_layers (OLMo 3's sliding "
                             "layers), or export a window on every layer as mistral")
        local = cfg.local_rope_theta
        if local is None and cfg.rope_scaling is not None and windowed:
            raise ModelError("olmo3's sliding layers rotate by unscaled RoPE: with model.rope_scaling set, "
                             "model.local_rope_theta must say their base")
        window = cfg.sliding_window
        super().attention_to_hf(cfg.__class__(**{**cfg.to_dict(), "sliding_window": None, "window_layers": None,
                                                 "local_rope_theta": None}), d)
        full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        d.update(layer_types=[SLIDING if i in windowed else FULL for i in range(cfg.n_layers)],
                 sliding_window=window,
                 rope_parameters={FULL: full, SLIDING: {"rope_type": "default",
                                                        "rope_theta": cfg.rope_theta if local is None else local}})


# YaRN on the full layers (65,536 positions from 8,192), the sliding ones unscaled
_OLMO3 = dict(qk_norm=True, qk_norm_all_heads=True, block_norms="post", sliding_window=4096, local_rope_theta=500000.0,
              rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                            "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1})
FAMILY = Olmo3(name="olmo3", architecture="Olmo3ForCausalLM", qk_norm=True, qk_norm_all_heads=True,
               block_norms="post", int_fields=("sliding_window",), presets={
    # allenai/Olmo-3-1025-7B and Olmo-3-1125-32B: three sliding layers (window 4096) to one full
    "olmo3-7b": dict(vocab_size=100278, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, norm_eps=1e-6,
                     rope_theta=500000.0, max_seq_len=65536, window_layers=[i for i in range(32) if (i + 1) % 4],
                     **_OLMO3),
    "olmo3-32b": dict(vocab_size=100278, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648,
                      norm_eps=1e-6, rope_theta=500000.0, max_seq_len=65536,
                      window_layers=[i for i in range(64) if (i + 1) % 4], **_OLMO3),
})
