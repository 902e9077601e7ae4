"""Qwen2-VL / Qwen2.5-VL HuggingFace directories (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`): read, checked, loaded, written.

    model = load_qwen_vl("qwen2.5-vl-dir", dtype=torch.float32)   # a tessera.models.vision.qwen_vl.QwenVL
    save_qwen_vl(model, "out/", tokenizer=..., processor=...)     # AutoModelForImageTextToText loads it

Names are handled in transformers 5's in-memory layout (`model.language_model.*`, `model.visual.*`,
`lm_head.weight`); files hold Qwen's own layout (`model.embed_tokens`, `model.layers.*`,
`model.norm`, `visual.*`), which is what transformers' `save_pretrained` writes too. Both are
read (`current_name`); the file layout is written (`saved_name`). The language model's names come
from the qwen2 family, the tower's from `vision_names`. The image processor travels as
`preprocessor_config.json` (tessera/data/qwen_image_processor.py): read when present, else the
processor the tower's patch sizes imply; always written.
"""

from __future__ import annotations

import os
import re

from tessera.checkpoint.hf.composite import DirectoryFormat, config_says
from tessera.checkpoint.hf.names import hf_names
from tessera.config.qwen_vl import (
    QwenVisionConfig,
    QwenVLConfig,
    is_qwen_vl_config,
    qwen_vl_config_to_hf,
    read_qwen_vl_file,
)
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.models.vision.qwen_vl import QwenVL

_TEXT = re.compile(r"^model\.(embed_tokens|layers|norm)\.")


def current_name(name: str) -> str:
    """A stored tensor name in transformers 5's in-memory layout."""
    if name.startswith("visual."):
        return "model." + name
    return _TEXT.sub(r"model.language_model.\1.", name)


def saved_name(name: str) -> str:
    """An in-memory name as the files (and transformers' `save_pretrained`) hold it."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name.replace("model.language_model.", "model.", 1)


def is_qwen_vl_directory(path: str | os.PathLike) -> bool:
    return config_says(path, is_qwen_vl_config)


def vision_names(v: QwenVisionConfig) -> dict[str, str]:
    """Tessera vision-tower key -> HuggingFace key, in model order."""
    pre = "model.visual."
    layer_norm = v.version == "qwen2_vl"
    norm_params = ("weight", "bias") if layer_norm else ("weight",)
    mlp = {"fc1": "fc1", "fc2": "fc2"} if layer_norm else {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    names = {"patch_embed.weight": f"{pre}patch_embed.proj.weight"}
    for i in range(v.n_layers):
        b = f"{pre}blocks.{i}."
        names.update({f"layers.{i}.norm1.{p}": f"{b}norm1.{p}" for p in norm_params})
        for p in ("weight", "bias"):
            names[f"layers.{i}.attention.wqkv.{p}"] = f"{b}attn.qkv.{p}"
            names[f"layers.{i}.attention.wo.{p}"] = f"{b}attn.proj.{p}"
        names.update({f"layers.{i}.norm2.{p}": f"{b}norm2.{p}" for p in norm_params})
        names.update({f"layers.{i}.mlp.{mine}.{p}": f"{b}mlp.{theirs}.{p}"
                      for mine, theirs in mlp.items() for p in ("weight", "bias")})
    names.update({f"merger.norm.{p}": f"{pre}merger.ln_q.{p}" for p in norm_params})
    for mine, theirs in (("linear_1", "mlp.0"), ("linear_2", "mlp.2")):
        names.update({f"merger.{mine}.{p}": f"{pre}merger.{theirs}.{p}" for p in ("weight", "bias")})
    return {f"vision_tower.{k}": h for k, h in names.items()}


def qwen_vl_names(cfg: QwenVLConfig) -> dict[str, str]:
    """Tessera `QwenVL` key -> HuggingFace key (transformers 5's in-memory layout), in model order."""
    names = dict(vision_names(cfg.vision))
    for key, hf_keys in hf_names(cfg.text).items():
        (h,) = hf_keys
        names[f"language_model.{key}"] = _in_memory(h)
    return names


def _listed_names(cfg: QwenVLConfig) -> dict[str, list[str]]:
    """`qwen_vl_names` with each HuggingFace key in a list, as the composite steps take them."""
    return {k: [h] for k, h in qwen_vl_names(cfg).items()}


def _in_memory(hf_key: str) -> str:
    """A qwen2 language model's HuggingFace key as Qwen2-VL's in-memory layout names it."""
    return hf_key if hf_key == "lm_head.weight" else hf_key.replace("model.", "model.language_model.", 1)


def language_model_names(names: dict[str, list[str]], stored: set[str]) -> tuple[dict[str, list[str]], set[str]]:
    """A qwen2 language model's Tessera -> HuggingFace names (`hf_names`) as a Qwen2-VL directory
    holding `stored` names them (either layout), and the stored keys that are not the language
    model's (the vision tower: a text run reads none of them)."""
    lookup = {current_name(k): k for k in stored}

    out = {key: [lookup.get(_in_memory(h), h) for h in hs] for key, hs in names.items()}
    used = {h for hs in out.values() for h in hs}
    return out, {k for k in stored if k not in used}


DIRECTORY = DirectoryFormat(read_qwen_vl_file, qwen_vl_config_to_hf, QwenVL, QwenImageProcessor, _listed_names,
                            current_name, saved_name, language_model_names)
load_qwen_vl = DIRECTORY.load  # (path, dtype, device) -> the directory's `QwenVL`, in eval mode
save_qwen_vl = DIRECTORY.save  # (model, path, tokenizer=, processor=, max_shard_bytes=): its directory written
