"""Qwen2-VL and Qwen2.5-VL: the native-resolution vision tower's shape and the whole model's, one
documented field at a time, and their config.json in both directions.

`QwenVisionConfig` is the vision transformer of `Qwen2VLForConditionalGeneration` (version
"qwen2_vl": LayerNorm, a fc1/fc2 MLP, full attention in every block, a LayerNorm before the merger)
or of `Qwen2_5_VLForConditionalGeneration` ("qwen2_5_vl": RMSNorm, a gated SwiGLU-style MLP with
biases, window attention except in `fullatt_blocks`, an RMSNorm before the merger). Both cut an
image into patch_size x patch_size x temporal_patch_size patches (a still image is repeated
temporally), rotate q and k by each patch's (row, column) and merge every 2x2 block of patches
(`spatial_merge_size`) into one language-model token. `QwenVLConfig` adds the language model (a
Qwen2 decoder, `ModelConfig` family "qwen2") with multimodal rotary positions: the rotary
frequencies are split into `mrope_section` (temporal, height, width) groups, each rotated by its
own coordinate of the token's 3-D position.

The same two classes describe Qwen3.5 / Qwen3.5-MoE with their tower (versions "qwen3_5",
"qwen3_5_moe", `QWEN3_TOWERS`: Qwen3-VL's tower, LayerNorm and a fc1/fc2 MLP as Qwen2-VL's, a
learned position table of `position_embeddings` entries), whose language model is a Qwen3.5 hybrid
(`TEXT_FAMILIES`) with its pairs dealt to the coordinates in turn (`mrope_interleaved`); their
config.json is read and written in tessera/config/qwen3_5_vl.py. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.config.errors import ConfigError, ModelError, require
from tessera.config.families import REGISTRY
from tessera.config.model import ModelConfig
from tessera.config.vision import read_config_file

VERSIONS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
# each version's language model (a text family, tessera/config/families)
TEXT_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_5": "qwen3_5_text",
                 "qwen3_5_moe": "qwen3_5_moe_text"}
# the towers of Qwen3-VL's kind (tessera/config/qwen3_5_vl.py): a biased patch embedding, a learned
# position table resampled to each image's grid, LayerNorm and a plain MLP, no windows
QWEN3_TOWERS = ("qwen3_5", "qwen3_5_moe")
VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")

# The defaults of transformers 5's config classes that a config.json may leave out.
_TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768,
                      rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
_VISION_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
                     in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       tokens_per_second=4, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31]),
}
_TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


@dataclass
class QwenVisionConfig:
    """The native-resolution vision transformer of Qwen2-VL / Qwen2.5-VL."""

    version: str = "qwen2_vl"  # one of VERSIONS
    dim: int = 1280  # the tower's width (Qwen2-VL's embed_dim, Qwen2.5-VL's hidden_size)
    n_layers: int = 32
    n_heads: int = 16
    ffn_dim: int = 5120  # the MLP's hidden size (Qwen2-VL: dim x mlp_ratio)
    act: str = "quick_gelu"  # the MLP's activation, one of VISION_ACTS
    out_dim: int = 3584  # the merger's output: the language model's width
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2  # frames per patch; a still image is repeated this many times
    spatial_merge_size: int = 2  # a merge_size x merge_size block of patches becomes one token
    rope_theta: float = 10000.0  # the 2-D rotary positions' base
    window_size: int = 112  # Qwen2.5-VL: a window's side in pixels (window attention)
    fullatt_blocks: list[int] = field(default_factory=list)  # Qwen2.5-VL: blocks attending over the whole image
    tokens_per_second: int = 4  # Qwen2.5-VL: videos' temporal position spacing (kept for export; no video here)
    position_embeddings: int = 0  # Qwen3-VL's kind: entries of the learned (square) position table; 0: none

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (with a bias) before each block's halves and the merger; RMSNorm otherwise."""
        return self.version != "qwen2_5_vl"

    @property
    def gated_mlp(self) -> bool:
        """A gated SwiGLU-style MLP (Qwen2.5-VL); fc2(act(fc1 x)) otherwise."""
        return self.version == "qwen2_5_vl"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """Values of one flattened patch (a row of pixel_values)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def validate(self) -> None:
        require(self.version in VERSIONS, "vision.version", self.version, f"one of {', '.join(VERSIONS)}")
        require(self.act in VISION_ACTS, "vision.act", self.act, f"one of {', '.join(VISION_ACTS)}")
        for key in ("dim", "n_layers", "n_heads", "ffn_dim", "out_dim", "in_channels", "patch_size",
                    "temporal_patch_size", "spatial_merge_size", "window_size"):
            value = getattr(self, key)
            require(isinstance(value, int) and value > 0, f"vision.{key}", value, "must be a positive integer")
        require(self.dim % self.n_heads == 0, "vision.n_heads", self.n_heads, f"must divide dim={self.dim}")
        require(self.head_dim % 4 == 0, "vision.n_heads", self.n_heads, "must leave a head size divisible by 4 (rows "
                f"and columns each rotate a quarter of its pairs); dim / n_heads = {self.head_dim}")
        require(all(isinstance(i, int) and 0 <= i < self.n_layers for i in self.fullatt_blocks),
                "vision.fullatt_blocks", self.fullatt_blocks, f"block indices in 0..{self.n_layers - 1}")
        if self.version in QWEN3_TOWERS:
            side = int(round(self.position_embeddings**0.5))
            require(self.position_embeddings > 0 and side * side == self.position_embeddings,
                    "vision.position_embeddings", self.position_embeddings, "a positive square (a side x side table)")
        elif self.version == "qwen2_vl":
            require(self.ffn_dim % self.dim == 0, "vision.ffn_dim", self.ffn_dim,
                    f"Qwen2-VL's MLP is dim x mlp_ratio: a multiple of {self.dim}")
        else:
            unit = self.patch_size * self.spatial_merge_size
            require(self.window_size % unit == 0, "vision.window_size", self.window_size,
                    f"a multiple of patch_size x spatial_merge_size = {unit}")


def default_mrope_section(head_dim: int) -> list[int]:
    """Qwen's split of a head's rotary pairs over (temporal, height, width): 3/8 each to height and
    width, the rest (about 1/4) temporal; [16, 24, 24] for head_dim 128."""
    half = head_dim // 2
    side = 3 * half // 8
    return [half - 2 * side, side, side]


@dataclass
class QwenVLConfig:
    """Qwen2-VL / Qwen2.5-VL: the tower's merged tokens take the places of `image_token_id` placeholders."""

    text: ModelConfig
    vision: QwenVisionConfig = field(default_factory=QwenVisionConfig)
    image_token_id: int = 151655  # the placeholder; an image takes grid_h x grid_w / merge^2 of them in a row
    video_token_id: int = 151656
    vision_start_token_id: int = 151652  # what the chat template puts before an image's placeholders
    vision_end_token_id: int = 151653
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])  # rotary pairs per (t, h, w)
    mrope_interleaved: bool = False  # Qwen3.5: the pairs dealt to (t, h, w) in turn (tessera/models/rope.py)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def family(self) -> str:
        """The vision-language family (config.json's model_type; tessera/config/vision_families.py)."""
        return self.vision.version

    version = family  # which of Qwen2-VL and Qwen2.5-VL

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image with this patch grid (known before any forward)."""
        t, h, w = grid_thw
        return t * h * w // self.vision.spatial_merge_size**2

    def validate(self) -> None:
        self.vision.validate()
        text = TEXT_FAMILIES[self.version]
        if self.text.family != text:
            raise ConfigError(f"{self.version}: the language model is a {text} decoder; got family "
                              f"{self.text.family!r}")
        pairs = self.text.rope_dim // 2
        if (not isinstance(self.mrope_section, list) or len(self.mrope_section) != 3
                or sum(self.mrope_section) != pairs):
            raise ConfigError(f"{self.version}.mrope_section={self.mrope_section!r} is invalid: three counts of rotary "
                              f"pairs (temporal, height, width) summing to the rotated head_dim / 2 = {pairs}")
        if self.vision.out_dim != self.text.dim:
            raise ConfigError(f"{self.version}: the vision merger outputs {self.vision.out_dim} features but the "
                              f"language model's width is {self.text.dim}")
        if not 0 <= self.image_token_id < self.text.vocab_size:  # the others only mark places in a chat template
            raise ConfigError(f"{self.version}.image_token_id={self.image_token_id!r} is invalid: must be a token of "
                              f"the language model's vocabulary (0..{self.text.vocab_size - 1})")


# ---- config.json ---------------------------------------------------------------------------------
def is_qwen_vl_config(d: Mapping[str, Any]) -> bool:
    """Qwen2-VL's or Qwen2.5-VL's config.json (Qwen3.5's: tessera/config/qwen3_5_vl.py)."""
    return d.get("model_type") in ("qwen2_vl", "qwen2_5_vl")


def _object(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ModelError(f"{what} must be a JSON object, got {type(d).__name__}")
    return dict(d)


def _text_from_hf(d: Mapping[str, Any]) -> tuple[ModelConfig, list[int]]:
    """The language model and mrope_section: from `text_config`, or the top level (older files)."""
    text = {**_TEXT_DEFAULTS, **_object(d.get("text_config") or
                                        {k: v for k, v in d.items() if k not in ("vision_config",)}, "text_config")}
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    section = rope.pop("mrope_section", [16, 24, 24])
    if rope.get("rope_type", rope.get("type")) == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text.pop("rope_scaling", None)
    if "rope_theta" in rope:
        text["rope_theta"] = rope.pop("rope_theta")
    if rope and rope.get("rope_type", "default") != "default":
        raise ModelError(f"{d['model_type']} rope parameters {rope!r}: only the default rotary frequencies "
                         "(with mrope_section) are supported")
    if d.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    fields = REGISTRY["qwen2"].config_from_hf({**text, "model_type": "qwen2"})
    return ModelConfig(**fields), list(section)


def vision_from_hf(version: str, v: Mapping[str, Any]) -> QwenVisionConfig:
    v = {**_VISION_DEFAULTS[version], **v}
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v[key], int):
            raise ModelError(f"vision_config.{key}={v[key]!r}: only one integer is supported")
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if version == "qwen2_vl":
        return QwenVisionConfig(version=version, dim=v["embed_dim"], n_layers=v["depth"], n_heads=v["num_heads"],
                                ffn_dim=int(v["embed_dim"] * v["mlp_ratio"]), act=v["hidden_act"],
                                out_dim=v["hidden_size"], in_channels=v["in_channels"], patch_size=v["patch_size"],
                                temporal_patch_size=v["temporal_patch_size"],
                                spatial_merge_size=v["spatial_merge_size"], rope_theta=theta)
    return QwenVisionConfig(version=version, dim=v["hidden_size"], n_layers=v["depth"], n_heads=v["num_heads"],
                            ffn_dim=v["intermediate_size"], act=v["hidden_act"], out_dim=v["out_hidden_size"],
                            in_channels=v["in_channels"], patch_size=v["patch_size"],
                            temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["spatial_merge_size"],
                            rope_theta=theta, window_size=v["window_size"],
                            fullatt_blocks=list(v["fullatt_block_indexes"]), tokens_per_second=v["tokens_per_second"])


def qwen_vl_config_from_hf(d: Mapping[str, Any]) -> QwenVLConfig:
    """A `QwenVLConfig` from Qwen2-VL's / Qwen2.5-VL's config.json (sub-configs completed with defaults)."""
    version = d["model_type"]
    text, section = _text_from_hf(d)
    vision = vision_from_hf(version, _object(d.get("vision_config") or {}, "vision_config"))
    tokens = {k: d.get(k, default) for k, default in _TOKEN_DEFAULTS.items()}
    return QwenVLConfig(text=text, vision=vision, mrope_section=section, **tokens)


def read_qwen_vl_file(d: Mapping[str, Any], source: str) -> QwenVLConfig:
    """`qwen_vl_config_from_hf` of config.json `source`'s object `d` (`read_config_file`)."""
    return read_config_file(qwen_vl_config_from_hf, d, source)


def vision_to_hf(v: QwenVisionConfig) -> dict[str, Any]:
    common = {"model_type": f"{v.version}_vision", "depth": v.n_layers, "num_heads": v.n_heads, "hidden_act": v.act,
              "in_channels": v.in_channels, "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
              "spatial_merge_size": v.spatial_merge_size, "rope_parameters": {"rope_theta": v.rope_theta,
                                                                              "rope_type": "axial"}}
    if v.version == "qwen2_vl":
        return {**common, "embed_dim": v.dim, "mlp_ratio": v.ffn_dim // v.dim, "hidden_size": v.out_dim}
    return {**common, "hidden_size": v.dim, "intermediate_size": v.ffn_dim, "out_hidden_size": v.out_dim,
            "window_size": v.window_size, "fullatt_block_indexes": list(v.fullatt_blocks),
            "tokens_per_second": v.tokens_per_second}


def qwen_vl_config_to_hf(cfg: QwenVLConfig) -> dict[str, Any]:
    """The config.json of `cfg`, every field written (no reliance on transformers' defaults)."""
    text = REGISTRY["qwen2"].config_to_hf(cfg.text)
    text.pop("architectures", None)
    text.pop("rope_scaling", None)
    text["model_type"] = f"{cfg.version}_text"
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": list(cfg.mrope_section)}
    return {"architectures": [VERSIONS[cfg.version]], "model_type": cfg.version, "text_config": text,
            "vision_config": vision_to_hf(cfg.vision), **{k: getattr(cfg, k) for k in _TOKEN_DEFAULTS},
            "tie_word_embeddings": cfg.text.tie_embeddings}


def qwen_vl_config_from_section(v: Any, text: ModelConfig) -> QwenVLConfig:
    """The Qwen2-VL / Qwen2.5-VL (`v.family`) of a fine-tune's train.vision_language fields `v`
    (tessera.config.training.vision_training) over language model `text` (a qwen2 decoder): its special
    tokens the vocabulary's last ids unless given, the tower's output the model's width."""
    vocab = text.vocab_size
    tokens = {"image_token_id": vocab - 1 if v.image_token_id is None else v.image_token_id,
              "vision_start_token_id": vocab - 3 if v.vision_start_token_id is None else v.vision_start_token_id,
              "vision_end_token_id": vocab - 2 if v.vision_end_token_id is None else v.vision_end_token_id,
              "video_token_id": vocab - 4}
    for key, token in tokens.items():
        same = [k for k, t in tokens.items() if t == token and k != key]
        if not 0 <= token < vocab or same:
            shown = f"train.vision_language.{key}" if key != "video_token_id" else "the video token (vocab_size - 4)"
            why = f"the same id as {', '.join(same)}" if same else "outside the vocabulary"
            raise ConfigError(f"{shown}={token} is invalid ({why}): the image, vision start / end and video tokens "
                              f"are distinct ids of the language model's vocabulary (0..{vocab - 1}); got {tokens}")
    section = list(v.mrope_section) if v.mrope_section is not None else default_mrope_section(text.head_dim)
    try:
        return QwenVLConfig(text=text, vision=replace(v.qwen_tower, version=v.family, out_dim=text.dim),
                            mrope_section=section, **tokens)
    except ConfigError as e:
        raise ConfigError(f"train.vision_language: {e}") from e


def refuse_qwen_layouts(p: Any) -> None:
    """The layouts a Qwen2-VL / Qwen2.5-VL fine-tune does not take, refused by name (ConfigError):
    expert parallelism (the language model is a dense qwen2 decoder)."""
    require(p.ep == 1, "parallel.ep", p.ep,
            "1 with data.kind=vision_sft on Qwen2-VL / Qwen2.5-VL: their language model is a dense qwen2 decoder, "
            "which has no routed experts to split over ep")
