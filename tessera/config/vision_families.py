"""The vision-language families, one registry per layer that needs one, and how to add a family.

A vision-language family is one of Tessera's language models (any text family,
tessera/config/families) with an image side whose rows take the places of image placeholder
tokens. Families are named by config.json's model_type: "llava" (LLaVA), "qwen2_vl" and
"qwen2_5_vl" (Qwen2-VL and Qwen2.5-VL, one set of modules for both), "qwen3_5" and "qwen3_5_moe"
(Qwen3.5's, Qwen2-VL's modules with Qwen3-VL's tower where it differs). A layer may import only the
layers below it (tests/test_layers.py), so each layer holds the family's parts it can name:

- config (here): its config class (`text`, `vision`, `image_token_id`, a `family` property giving
  the name), config.json in both directions, its config from a fine-tune's train.vision_language
  fields, and the training layouts it refuses: a `ConfigFamily` in `REGISTRY` below;
- models: its model class, a `VisionLanguageModel` (tessera/models/vision/vision_language.py): the
  vision seam (`encode_images`, `forward`) and what the engine and the trainer ask of a family
  (placeholders of a served image, a chat's image part, its own rotary positions, the parts the
  freeze switches name);
- data: its image processor (the interface of `ImageProcessorFile`, tessera/data/image_processor.py)
  and its fine-tuning samples (tessera/data/vision_sft.py);
- checkpoint: its HuggingFace directory (a `DirectoryFormat`, tessera/checkpoint/hf/composite.py:
  config.json both ways, model and processor classes, tensor names, load and save), and the
  family's whole spec, that directory and its samples: a `VisionLanguageFamily` in
  tessera/checkpoint/vision_families.py's `REGISTRY`.
Serving and training (tessera/infer, tessera/train) name no family: they ask the model and the
registries, by the model's `family`.

Adding a family "x":
1. tessera/config/x.py: `XConfig` and its functions (config.json both ways, from_section, the
   layouts it refuses); its line in `REGISTRY` below (its title and loader for messages, then those).
2. tessera/models/vision/x.py: `X(VisionLanguageModel)`, with `encode_images`, `forward` and the answers
   whose default it changes (`image_input` always).
3. tessera/data/x_image_processor.py: its image processor; its samples function in
   tessera/data/vision_sft.py.
4. tessera/checkpoint/hf/x.py: its tensor names and its `DIRECTORY` (a `DirectoryFormat` of its
   parts); its line in tessera/checkpoint/vision_families.py's `REGISTRY`.
5. Its tests: parity with transformers (tests/models), serving (tests/infer), fine-tuning
   (tests/train) and conversion (tests/checkpoint); its modules in tests/test_layers.py's
   `VISION_LANGUAGE_FAMILY` (the cores must not import them).
No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import ModelError
from tessera.config.model import ModelConfig
from tessera.config.qwen3_5_vl import qwen3_5_vl_config_from_hf, qwen3_5_vl_config_from_section, qwen3_5_vl_config_to_hf
from tessera.config.qwen_vl import (
    qwen_vl_config_from_hf,
    qwen_vl_config_from_section,
    qwen_vl_config_to_hf,
    refuse_qwen_layouts,
)
from tessera.config.vision import llava_config_from_hf, llava_config_from_section, llava_config_to_hf, read_config_file


def _every_layout(parallel: Any) -> None:
    """A family whose fine-tune takes every layout of its language model refuses none."""


@dataclass(frozen=True)
class ConfigFamily:
    """A vision-language family's config functions: the config layer's entry."""

    title: str  # the family as people name it, for messages ("LLaVA")
    loader: str  # the function that loads its directory, for messages that point to it
    from_hf: Callable[[Mapping[str, Any]], Any]  # config.json -> its config (ModelError: not reproducible)
    to_hf: Callable[[Any], dict[str, Any]]  # its config -> config.json, every field written
    from_section: Callable[[Any, ModelConfig], Any]  # train.vision_language's fields over a language model
    # (parallel section): refuse by name (ConfigError) the layouts its fine-tune does not take
    refuse_layouts: Callable[[Any], None] = _every_layout


_QWEN_VL = ConfigFamily("Qwen2-VL / Qwen2.5-VL", "tessera.checkpoint.hf.qwen_vl.load_qwen_vl", qwen_vl_config_from_hf,
                        qwen_vl_config_to_hf, qwen_vl_config_from_section, refuse_qwen_layouts)
_QWEN3_5_VL = ConfigFamily("Qwen3.5 / Qwen3.5-MoE", "tessera.checkpoint.hf.qwen3_5_vl.load_qwen3_5_vl",
                           qwen3_5_vl_config_from_hf, qwen3_5_vl_config_to_hf, qwen3_5_vl_config_from_section)
REGISTRY: dict[str, ConfigFamily] = {
    "llava": ConfigFamily("LLaVA", "tessera.checkpoint.hf.llava.load_llava", llava_config_from_hf, llava_config_to_hf,
                          llava_config_from_section),
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "qwen3_5": _QWEN3_5_VL,
    "qwen3_5_moe": _QWEN3_5_VL,
}


def family_of_config(d: Mapping[str, Any]) -> ConfigFamily | None:
    """The vision-language family whose config.json object `d` is; None for any other."""
    name = d.get("model_type")
    return REGISTRY.get(name) if isinstance(name, str) else None


def is_vision_language_config(d: Mapping[str, Any]) -> bool:
    """Whether config.json object `d` is a vision-language family's."""
    return d.get("model_type") in REGISTRY


def vision_language_config_from_hf(d: Mapping[str, Any]) -> Any:
    """The config of a vision-language family's config.json `d` (its model_type names the family)."""
    family = REGISTRY.get(d.get("model_type"))
    if family is None:
        raise ModelError(f"config.json model_type={d.get('model_type')!r} is not a vision-language family; allowed: "
                         f"{', '.join(REGISTRY)}")
    return family.from_hf(d)


def vision_language_config_to_hf(cfg: Any) -> dict[str, Any]:
    """The config.json of a vision-language family's config, every field written."""
    return REGISTRY[cfg.family].to_hf(cfg)


def read_vision_language_file(d: Mapping[str, Any], source: str) -> Any:
    """`vision_language_config_from_hf` of config.json `source`'s object `d` (`read_config_file`)."""
    return read_config_file(vision_language_config_from_hf, d, source)
