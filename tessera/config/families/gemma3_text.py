"""Gemma 3 text (Gemma3ForCausalLM): five sliding-window layers to one global (config.json's
`layer_types`, `model.window_layers` here), the sliding layers rotating by their own unscaled base
(`model.local_rope_theta`; legacy `rope_local_base_freq`) and the global ones by `rope_theta` with
any scaling; RMSNorms before and after attention and MLP (`block_norms="pre_post"`) and on q and k
per head, each scaling by (1 + weight) (`model.norm_unit_offset`); GeGLU with the tanh GELU
(`model.activation`), embeddings scaled by sqrt(hidden) (`model.embed_scale`) and the softmax
scaled by `query_pre_attn_scalar`^-0.5. Logit soft-capping (attention or final), which no
published Gemma 3 uses, and bidirectional attention are refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ModelError
from tessera.config.families.base import Family, rope_from_hf
from tessera.config.families.olmo3 import FULL, SLIDING, window_fields

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig.default_theta


def layer_ropes(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(full layers' theta, their scaling, sliding layers' theta), as transformers reads config.json."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, sliding = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full = {k: v for k, v in (d.get("rope_scaling") or {}).items()}
        full["rope_theta"] = d.get("rope_theta", GLOBAL_THETA)
        sliding = {"rope_theta": d.get("rope_local_base_freq", LOCAL_THETA)}
    theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": GLOBAL_THETA, **full}})
    local, local_scaling = rope_from_hf({"rope_parameters": {"rope_theta": LOCAL_THETA, **sliding}})
    if local_scaling is not None:
        raise ModelError(f"rope_parameters.{SLIDING}={sliding} is not supported: Tessera's sliding layers rotate "
                         "by unscaled RoPE")
    return theta, scaling, local


@dataclass(frozen=True)
class Gemma3Text(Family):
    layer_windows: ClassVar[bool] = True
    own_parts: ClassVar[tuple[str, ...]] = ("activation", "norm_unit_offset", "embed_scale", "query_pre_attn_scalar")

    def config_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        act = d.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelError(f"hidden_activation={act!r} is not supported; Gemma 3's MLP is GeGLU (gelu_pytorch_tanh)")
        for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
            if d.get(key):
                raise ModelError(f"{key}={d[key]!r} is not supported for gemma3_text (no published Gemma 3 uses it)")
        fields = super().config_from_hf({k: v for k, v in d.items() if k != "hidden_act"})
        fields.update(activation="gelu_tanh", norm_unit_offset=True, embed_scale=True,
                      query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                      head_dim=d.get("head_dim", 256), norm_eps=d.get("rms_norm_eps", 1e-6),
                      tie_embeddings=bool(d.get("tie_word_embeddings", True)),
                      max_seq_len=d.get("max_position_embeddings", 131072))
        return fields

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return super().attention_from_hf(d) | window_fields(d, d.get("sliding_window_pattern", 6), layer_ropes)

    def config_to_hf(self, cfg) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        del d["hidden_act"]
        scalar = cfg.query_pre_attn_scalar  # transformers' field is an integer
        d.update(hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
                 final_logit_softcapping=None, attn_logit_softcapping=None)
        return d

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        windowed = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is not None]
        if cfg.sliding_window is not None and cfg.window_layers is None:
            raise ModelError("gemma3_text keeps some layers without a window: give model.window_layers (its sliding "
                             "layers), or export a window on every layer as mistral")
        if not (cfg.activation == "gelu_tanh" and cfg.norm_unit_offset and cfg.embed_scale
                and cfg.query_pre_attn_scalar is not None):
            raise ModelError("gemma3_text's class has GeGLU, (1 + weight) norms, scaled embeddings and a "
                             "query_pre_attn_scalar: model.activation=gelu_tanh, model.norm_unit_offset=true, "
                             "model.embed_scale=true and model.query_pre_attn_scalar must be set")
        local = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        if cfg.local_rope_theta is None and cfg.rope_scaling is not None and windowed:
            raise ModelError("gemma3_text's sliding layers rotate by unscaled RoPE: with model.rope_scaling set, "
                             "model.local_rope_theta must say their base")
        window = cfg.sliding_window
        super().attention_to_hf(cfg.__class__(**{**cfg.to_dict(), "sliding_window": None, "window_layers": None,
                                                 "local_rope_theta": None}), d)
        full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        d.pop("rope_scaling")
        d.pop("rope_theta")
        d.update(layer_types=[SLIDING if i in windowed else FULL for i in range(cfg.n_layers)],
                 sliding_window=window or cfg.max_seq_len,
                 rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}})


_GEMMA = dict(qk_norm=True, block_norms="pre_post", activation="gelu_tanh", norm_unit_offset=True, embed_scale=True,
              tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6, local_rope_theta=1e4)
_LINEAR8 = {"rope_type": "linear", "factor": 8.0}  # the global layers of the 4B, 12B and 27B


def _every_sixth_global(n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if (i + 1) % 6]


FAMILY = Gemma3Text(name="gemma3_text", architecture="Gemma3ForCausalLM", qk_norm=True, block_norms="pre_post",
                    int_fields=("sliding_window", "sliding_window_pattern"),
                    number_fields=("query_pre_attn_scalar", "rope_local_base_freq"), presets={
    # google/gemma-3-1b-pt, and the text models of gemma-3-4b-pt, 12b-pt and 27b-pt
    "gemma3-1b": dict(vocab_size=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                      max_seq_len=32768, sliding_window=512, window_layers=_every_sixth_global(26),
                      query_pre_attn_scalar=256.0, **_GEMMA),
    "gemma3-4b": dict(vocab_size=262208, dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=10240,
                      max_seq_len=131072, sliding_window=1024, window_layers=_every_sixth_global(34),
                      query_pre_attn_scalar=256.0, rope_scaling=_LINEAR8, **_GEMMA),
    "gemma3-12b": dict(vocab_size=262208, dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, head_dim=256,
                       ffn_dim=15360, max_seq_len=131072, sliding_window=1024, window_layers=_every_sixth_global(48),
                       query_pre_attn_scalar=256.0, rope_scaling=_LINEAR8, **_GEMMA),
    "gemma3-27b": dict(vocab_size=262208, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128,
                       ffn_dim=21504, max_seq_len=131072, sliding_window=1024, window_layers=_every_sixth_global(62),
                       query_pre_attn_scalar=168.0, rope_scaling=_LINEAR8, **_GEMMA),
})
