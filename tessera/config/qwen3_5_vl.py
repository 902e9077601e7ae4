"""Qwen3.5 and Qwen3.5-MoE with their vision tower (config.json model_type "qwen3_5", "qwen3_5_moe"):
config.json in both directions, as a `QwenVLConfig` (tessera/config/qwen_vl.py) whose tower is of
Qwen3-VL's kind (`QWEN3_TOWERS`) and whose language model is the text family `qwen3_5_text` /
`qwen3_5_moe_text` (tessera/config/families/hybrid), with interleaved M-RoPE (`mrope_interleaved`).

The tower's fields: hidden_size (its width), depth, num_heads, intermediate_size (the MLP), hidden_act,
out_hidden_size (the language model's width), patch_size, temporal_patch_size, spatial_merge_size,
num_position_embeddings (the learned position table, a square) and its rotary base. The language
model's rope_parameters carry mrope_section and mrope_interleaved beside its own rotary fields
(rope_theta, partial_rotary_factor). No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.config.errors import ConfigError, ModelError
from tessera.config.families import REGISTRY
from tessera.config.model import ModelConfig
from tessera.config.qwen_vl import TEXT_FAMILIES, VERSIONS, QwenVisionConfig, QwenVLConfig
from tessera.config.vision import read_config_file

# The defaults of transformers' Qwen3_5VisionConfig that a config.json may leave out.
_VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                        num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                        out_hidden_size=3584, num_position_embeddings=2304)
_TOKEN_DEFAULTS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                       vision_end_token_id=248054)
_ROPE = ("rope_theta", "partial_rotary_factor", "rope_type")


def _object(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ModelError(f"{what} must be a JSON object, got {type(d).__name__}")
    return dict(d)


def _text_from_hf(version: str, d: Mapping[str, Any]) -> tuple[ModelConfig, list[int], bool]:
    """The language model, mrope_section and mrope_interleaved of config.json `d`'s text_config."""
    text = _object(d.get("text_config") or {}, "text_config")
    rope = dict(text.pop("rope_parameters", None) or {})
    section = rope.pop("mrope_section", [11, 11, 10])
    interleaved = bool(rope.pop("mrope_interleaved", False))
    if rope.get("rope_type", "default") != "default" or set(rope) - set(_ROPE):
        raise ModelError(f"{version} text_config.rope_parameters {rope!r}: only the default rotary frequencies "
                         "(rope_theta, partial_rotary_factor, with mrope_section) are supported")
    text["rope_parameters"] = rope
    if d.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    family = TEXT_FAMILIES[version]
    return ModelConfig(**REGISTRY[family].config_from_hf({**text, "model_type": family})), list(section), interleaved


def vision_from_hf(version: str, v: Mapping[str, Any]) -> QwenVisionConfig:
    v = {**_VISION_DEFAULTS, **v}
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v[key], int):
            raise ModelError(f"vision_config.{key}={v[key]!r}: only one integer is supported")
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return QwenVisionConfig(version=version, dim=v["hidden_size"], n_layers=v["depth"], n_heads=v["num_heads"],
                            ffn_dim=v["intermediate_size"], act=v["hidden_act"], out_dim=v["out_hidden_size"],
                            in_channels=v["in_channels"], patch_size=v["patch_size"],
                            temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["spatial_merge_size"],
                            rope_theta=theta, position_embeddings=v["num_position_embeddings"])


def qwen3_5_vl_config_from_hf(d: Mapping[str, Any]) -> QwenVLConfig:
    """A `QwenVLConfig` from Qwen3.5's / Qwen3.5-MoE's config.json (sub-configs completed with defaults)."""
    version = d["model_type"]
    text, section, interleaved = _text_from_hf(version, d)
    vision = vision_from_hf(version, _object(d.get("vision_config") or {}, "vision_config"))
    tokens = {k: d.get(k, default) for k, default in _TOKEN_DEFAULTS.items()}
    return QwenVLConfig(text=text, vision=vision, mrope_section=section, mrope_interleaved=interleaved, **tokens)


def read_qwen3_5_vl_file(d: Mapping[str, Any], source: str) -> QwenVLConfig:
    """`qwen3_5_vl_config_from_hf` of config.json `source`'s object `d` (`read_config_file`)."""
    return read_config_file(qwen3_5_vl_config_from_hf, d, source)


def vision_to_hf(v: QwenVisionConfig) -> dict[str, Any]:
    return {"model_type": f"{v.version}_vision", "depth": v.n_layers, "hidden_size": v.dim, "num_heads": v.n_heads,
            "intermediate_size": v.ffn_dim, "hidden_act": v.act, "out_hidden_size": v.out_dim,
            "in_channels": v.in_channels, "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size, "num_position_embeddings": v.position_embeddings,
            "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"}}


def qwen3_5_vl_config_to_hf(cfg: QwenVLConfig) -> dict[str, Any]:
    """The config.json of `cfg`, every field written (no reliance on transformers' defaults)."""
    text = REGISTRY[TEXT_FAMILIES[cfg.version]].config_to_hf(cfg.text)
    text.pop("architectures", None)
    if text.pop("rope_scaling", None) is not None:
        raise ModelError(f"{cfg.version}: the language model's rope_scaling does not export (only the default "
                         "rotary frequencies with mrope_section)")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "partial_rotary_factor": text.pop("partial_rotary_factor", 1.0),
                               "mrope_section": list(cfg.mrope_section), "mrope_interleaved": cfg.mrope_interleaved}
    return {"architectures": [VERSIONS[cfg.version]], "model_type": cfg.version, "text_config": text,
            "vision_config": vision_to_hf(cfg.vision), **{k: getattr(cfg, k) for k in _TOKEN_DEFAULTS},
            "tie_word_embeddings": cfg.text.tie_embeddings}


def qwen3_5_vl_config_from_section(v: Any, text: ModelConfig) -> QwenVLConfig:
    """A Qwen3.5 fine-tune starts from its directory (train.init_from), never from a tower built here."""
    raise ConfigError(f"train.vision_language.family={v.family} is invalid without train.init_from: a Qwen3.5 "
                      "fine-tune starts from a Qwen3.5 HuggingFace directory (its tower and tokens come from it); "
                      "allowed without one: llava, qwen2_vl, qwen2_5_vl")

