"""Vision-language models: the vision tower's shape and LLaVA's, one documented field at a time.

`VisionConfig` is a ViT image encoder as transformers defines two of them: CLIP's vision model (a
class token, a LayerNorm before the first block, quick-GELU) and SigLIP's (no class token, a bias
on the patch projection, tanh-GELU, an attention-pooling head). `LlavaConfig` is
`LlavaForConditionalGeneration`: a vision tower, a two-layer projector from the chosen vision
hidden states into the language model's width, and any of Tessera's language-model families
(`ModelConfig`: dense, MoE, MLA); each image's features take the places of its `image_token_id`
placeholders.

HuggingFace's composite config.json stores sub-configs as the differences from their classes'
defaults (llava-hf's `text_config` is a handful of fields), so the defaults of the classes a
LLaVA directory names are listed here (`HF_DEFAULTS`), read from transformers' config classes.
No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import CheckpointError, ConfigError, ModelError, require
from tessera.config.families import REGISTRY
from tessera.config.model import ModelConfig

VISION_KINDS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}  # config.json model_type -> kind
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")  # the vision MLPs' and projector's activations
STRATEGIES = ("default", "full")  # default: drop the first token (CLIP's class token); full: keep every token
MAX_IMAGE_SIZE = 4096  # pixels per side of the vision tower's input

# The defaults of the transformers config classes a LLaVA config.json may leave out (transformers 5).
_LLAMA_LIKE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
                   tie_word_embeddings=False)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_LIKE,
    "mistral": {**_LLAMA_LIKE, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768},
    "qwen3": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "head_dim": 128},
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True),
    # LlavaConfig's own vision tower when config.json has no vision_config (llava-1.5's CLIP ViT-L/14-336)
    "llava_vision": dict(model_type="clip_vision_model", intermediate_size=4096, hidden_size=1024, patch_size=14,
                         image_size=336, num_hidden_layers=24, num_attention_heads=16),
}


@dataclass
class VisionConfig:
    """A ViT image encoder (CLIP's or SigLIP's vision model)."""

    kind: str = "clip"  # "clip": class token + pre-LayerNorm; "siglip": no class token, patch bias
    image_size: int = 336  # the square input the position table was trained for (no interpolation)
    patch_size: int = 14  # side of one patch; a token per patch
    num_channels: int = 3
    dim: int = 1024  # hidden size
    n_layers: int = 24
    n_heads: int = 16
    ffn_dim: int = 4096  # the MLP's hidden size (fc1 -> act -> fc2)
    norm_eps: float = 1e-5  # LayerNorm epsilon (CLIP 1e-5, SigLIP 1e-6)
    act: str = "quick_gelu"  # one of ACTIVATIONS
    use_head: bool = False  # SigLIP's attention-pooling head: held so an export keeps it; LLaVA never runs it

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens(self) -> int:
        """Tokens the tower outputs per image: one per patch, plus CLIP's class token."""
        return self.patches + (1 if self.kind == "clip" else 0)

    def validate(self) -> None:
        require(self.kind in ("clip", "siglip"), "vision.kind", self.kind, "one of clip, siglip")
        require(self.act in ACTIVATIONS, "vision.act", self.act, f"one of {', '.join(ACTIVATIONS)}")
        require(0 < self.patch_size <= self.image_size <= MAX_IMAGE_SIZE, "vision.image_size", self.image_size,
                f"must be in patch_size={self.patch_size}..{MAX_IMAGE_SIZE}")
        for key in ("num_channels", "dim", "n_layers", "n_heads", "ffn_dim"):
            value = getattr(self, key)
            require(isinstance(value, int) and value > 0, f"vision.{key}", value, "must be a positive integer")
        require(self.dim % self.n_heads == 0, "vision.n_heads", self.n_heads, f"must divide dim={self.dim}")
        require(self.use_head is False or self.kind == "siglip", "vision.use_head", self.use_head,
                "only SigLIP has an attention-pooling head")


@dataclass
class LlavaConfig:
    """LLaVA: vision tower -> projector -> the language model's input embeddings at image placeholders."""

    text: ModelConfig
    vision: VisionConfig = field(default_factory=VisionConfig)
    image_token_id: int = 32000  # the placeholder token; each image takes `image_tokens` of them in a row
    # Which hidden states of the tower feed the projector: an index into (embeddings, layer 1, ...,
    # layer n), negative from the end (-2: the second-to-last layer's output), or a list, concatenated.
    feature_layer: int | list[int] = -2
    select_strategy: str = "default"  # one of STRATEGIES
    projector_act: str = "gelu"  # between the projector's two linear layers
    projector_bias: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def family(self) -> str:
        """The vision-language family (config.json's model_type; tessera/config/vision_families.py)."""
        return "llava"

    @property
    def feature_layers(self) -> list[int]:
        """The tower's hidden-state indices in 0..n_layers, in the order they are concatenated."""
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        return [i % (self.vision.n_layers + 1) for i in layers]

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens one image takes (known before any forward)."""
        return self.vision.tokens - (1 if self.select_strategy == "default" else 0)

    def validate(self) -> None:
        self.vision.validate()
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        n = self.vision.n_layers
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) and -n - 1 <= i <= n for i in layers)):
            raise ConfigError(f"llava.feature_layer={self.feature_layer!r} is invalid: an integer or a non-empty list "
                              f"of integers in {-n - 1}..{n} (hidden states of the vision tower's {n} layers)")
        if self.select_strategy not in STRATEGIES:
            raise ConfigError(f"llava.select_strategy={self.select_strategy!r} is invalid: one of "
                              f"{', '.join(STRATEGIES)}")
        if self.projector_act not in ACTIVATIONS:
            raise ConfigError(f"llava.projector_act={self.projector_act!r} is invalid: one of {', '.join(ACTIVATIONS)}")
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ConfigError(f"llava.image_token_id={self.image_token_id!r} is invalid: must be a token of the "
                              f"language model's vocabulary (0..{self.text.vocab_size - 1})")
        if self.image_tokens < 1:
            raise ConfigError("llava: an image would take no tokens (one patch and select_strategy=default)")


# ---- config.json ---------------------------------------------------------------------------------
def is_llava_config(d: Mapping[str, Any]) -> bool:
    return d.get("model_type") == "llava"


def _with_defaults(d: Any, what: str) -> dict[str, Any]:
    """Sub-config `d` completed with its class's defaults where they are listed (HF_DEFAULTS); the
    other families' sub-configs must give every field they need."""
    if not isinstance(d, dict):
        raise ModelError(f"llava config.json: {what} must be a JSON object, got {type(d).__name__}")
    return {**HF_DEFAULTS.get(d.get("model_type"), {}), **d}


def vision_from_hf(d: Mapping[str, Any]) -> VisionConfig:
    kind = VISION_KINDS.get(d.get("model_type"))
    if kind is None:
        raise ModelError(f"vision_config model_type={d.get('model_type')!r} is not supported; allowed: "
                         f"{', '.join(VISION_KINDS)}")
    for key in ("image_size", "patch_size"):
        if not isinstance(d[key], int):
            raise ModelError(f"vision_config.{key}={d[key]!r}: only square sizes (one integer) are supported")
    return VisionConfig(kind=kind, image_size=d["image_size"], patch_size=d["patch_size"],
                        num_channels=d["num_channels"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
                        n_heads=d["num_attention_heads"], ffn_dim=d["intermediate_size"],
                        norm_eps=float(d["layer_norm_eps"]), act=d["hidden_act"],
                        use_head=bool(d.get("vision_use_head", False)) and kind == "siglip")


def llava_config_from_hf(d: Mapping[str, Any]) -> LlavaConfig:
    """A `LlavaConfig` from LLaVA's config.json (sub-configs completed with their classes' defaults)."""
    vision = _with_defaults(d.get("vision_config") or HF_DEFAULTS["llava_vision"], "vision_config")
    text = _with_defaults(d.get("text_config") or {"model_type": "llama"}, "text_config")
    family = REGISTRY.get(text.get("model_type"))
    if family is None:
        raise ModelError(f"llava text_config model_type={text.get('model_type')!r} is not supported; allowed: "
                         f"{', '.join(REGISTRY)}")
    if d.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    if d.get("image_grid_pinpoints") is not None:
        raise ModelError("llava config.json: image_grid_pinpoints belongs to LLaVA-NeXT, which is not supported")
    return LlavaConfig(text=ModelConfig(**family.config_from_hf(text)), vision=vision_from_hf(vision),
                       image_token_id=d.get("image_token_index", d.get("image_token_id", 32000)),
                       feature_layer=d.get("vision_feature_layer", -2),
                       select_strategy=d.get("vision_feature_select_strategy", "default"),
                       projector_act=d.get("projector_hidden_act", "gelu"),
                       projector_bias=bool(d.get("multimodal_projector_bias", True)))


def llava_config_from_section(v: Any, text: ModelConfig) -> LlavaConfig:
    """The LLaVA of a fine-tune's train.vision_language fields `v` (tessera.config.training.vision_training)
    over language model `text`: its image token the vocabulary's last id unless given."""
    token = v.image_token_id if v.image_token_id is not None else text.vocab_size - 1
    layers = v.feature_layer[0] if len(v.feature_layer) == 1 else list(v.feature_layer)
    try:
        return LlavaConfig(text=text, vision=v.tower, image_token_id=token, feature_layer=layers,
                           select_strategy=v.select_strategy, projector_act=v.projector_act)
    except ConfigError as e:
        raise ConfigError(f"train.vision_language: {e}") from e


def read_llava_file(d: Mapping[str, Any], source: str) -> LlavaConfig:
    """`llava_config_from_hf` of config.json `source`'s object `d` (`read_config_file`)."""
    return read_config_file(llava_config_from_hf, d, source)


def read_config_file(parse: Callable[[Mapping[str, Any]], Any], d: Mapping[str, Any], source: str) -> Any:
    """`parse(d)` of config.json `source`'s object `d`: what Tessera does not reproduce is a
    ModelError, any other problem one CheckpointError naming the file."""
    try:
        return parse(d)
    except ModelError:
        raise
    except ConfigError as e:
        raise CheckpointError(f"{source!r}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{source!r}: a field is missing or has the wrong type ({e!r})") from e


def vision_to_hf(v: VisionConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"model_type": f"{v.kind}_vision_model", "hidden_size": v.dim, "intermediate_size": v.ffn_dim,
                         "num_hidden_layers": v.n_layers, "num_attention_heads": v.n_heads,
                         "num_channels": v.num_channels, "image_size": v.image_size, "patch_size": v.patch_size,
                         "hidden_act": v.act, "layer_norm_eps": v.norm_eps}
    if v.kind == "siglip":
        d["vision_use_head"] = v.use_head
    return d


def llava_config_to_hf(cfg: LlavaConfig) -> dict[str, Any]:
    """LLaVA's config.json of `cfg`, every field written (no reliance on transformers' defaults)."""
    family = REGISTRY[cfg.text.family]
    text = family.config_to_hf(cfg.text)
    text.pop("architectures", None)
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "text_config": text, "vision_config": vision_to_hf(cfg.vision),
            "image_token_index": cfg.image_token_id, "image_seq_length": cfg.image_tokens,
            "vision_feature_layer": cfg.feature_layer, "vision_feature_select_strategy": cfg.select_strategy,
            "projector_hidden_act": cfg.projector_act, "multimodal_projector_bias": cfg.projector_bias,
            "tie_word_embeddings": cfg.text.tie_embeddings}
