"""Each vision-language family's parts, from its model class to its files: the family's spec, by name.

This is the lowest layer that sees every part of a family (its config, model, image processor,
fine-tuning samples and HuggingFace directory), so the spec lives here; the config layer keeps its
own registry of what it needs first (tessera/config/vision_families.py, which also says how to add a
family). Serving, training, conversion and export ask `REGISTRY[model.family]` (or a directory's
family) instead of testing for a family:

    family = REGISTRY[model.family]
    family.directory.save(model, "out/")                          # its HuggingFace directory written
    processor = default_processor(model.cfg)                      # the processor its tower ships with
    model, processor = load_directory_model(path, torch.bfloat16) # any family's HuggingFace directory
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.hf import llava, qwen3_5_vl, qwen_vl
from tessera.checkpoint.hf.composite import DirectoryFormat, read_directory_config
from tessera.config.errors import CheckpointError
from tessera.config.hf_config import read_json_object
from tessera.config.vision_families import read_vision_language_file
from tessera.data.vision_sft import llava_samples, qwen_vl_samples
from tessera.models.vision.vision_language import VisionLanguageModel


@dataclass(frozen=True)
class VisionLanguageFamily:
    """A vision-language family's parts (module docstring)."""

    # its HuggingFace directory: config.json both ways, model and image processor classes, tensor
    # names, load / read_processor / save (tessera/checkpoint/hf/composite.py)
    directory: DirectoryFormat
    # (JSONL inputs, tokenizer, processor, config, seq_len) -> data.kind=vision_sft's samples (data/vision_sft.py)
    samples: Callable[..., list]


_QWEN_VL = VisionLanguageFamily(qwen_vl.DIRECTORY, qwen_vl_samples)
_QWEN3_5_VL = VisionLanguageFamily(qwen3_5_vl.DIRECTORY, qwen_vl_samples)
REGISTRY: dict[str, VisionLanguageFamily] = {
    "llava": VisionLanguageFamily(llava.DIRECTORY, llava_samples),
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "qwen3_5": _QWEN3_5_VL,
    "qwen3_5_moe": _QWEN3_5_VL,
}


def directory_family(path: str | os.PathLike) -> VisionLanguageFamily | None:
    """The family of vision-language HuggingFace directory `path` (its config.json's model_type);
    None for any other path, or one whose config.json cannot be read."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        name = read_json_object(f).get("model_type")
    except CheckpointError:
        return None
    return REGISTRY.get(name) if isinstance(name, str) else None


def is_vision_language_directory(path: str | os.PathLike) -> bool:
    """Whether `path` is a vision-language family's HuggingFace directory."""
    return directory_family(path) is not None


def read_directory_model_config(path: str | os.PathLike) -> Any:
    """The family config of vision-language HuggingFace directory `path` (its config.json)."""
    return read_directory_config(path, read_vision_language_file)


def read_directory_processor(path: str | os.PathLike, cfg: Any) -> Any:
    """The image processor of vision-language directory `path` whose model config is `cfg`."""
    return REGISTRY[cfg.family].directory.read_processor(path, cfg)


def default_processor(cfg: Any) -> Any:
    """The image processor the tower of family config `cfg` ships with."""
    return REGISTRY[cfg.family].directory.processor.for_vision(cfg.vision)


def load_directory_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[VisionLanguageModel, Any]:
    """The model of vision-language HuggingFace directory `path`, in eval mode, and its image processor."""
    family = REGISTRY[read_directory_model_config(path).family]
    model = family.directory.load(path, dtype, device)
    return model, family.directory.read_processor(path, model.cfg)


def family_names(family: VisionLanguageFamily | None = None) -> list[str]:
    """The names `family`'s parts serve (Qwen2-VL's and Qwen2.5-VL's together); None: every family's."""
    return [name for name, f in REGISTRY.items() if family is None or f is family]
