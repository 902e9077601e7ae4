"""LLaVA HuggingFace directories (`LlavaForConditionalGeneration`): read, checked, loaded, written.

    model = load_llava("llava-dir", dtype=torch.float32)     # a tessera.models.vision.llava.Llava
    save_llava(model, "out/", tokenizer=..., processor=...)  # transformers' AutoModelForImageTextToText loads it

Names are handled in transformers 5's in-memory layout (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.weight`). Files come in others:
llava-hf's checkpoints (`language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`) and what transformers 5's `save_pretrained`
writes (the same, but `vision_tower.*`). Every one is read (`current_name`); the last is written
(`saved_name`), so an export is what transformers itself would save. The language
model's names come from its family, the tower's from `vision_names`. The image processor travels
as `preprocessor_config.json` (tessera/data/image_processor.py): read when present, else the
processor the tower ships with; always written.
"""

from __future__ import annotations

import os
import re

from tessera.checkpoint.hf.composite import DirectoryFormat, config_says
from tessera.checkpoint.hf.names import check_exportable, hf_names
from tessera.config.vision import LlavaConfig, VisionConfig, is_llava_config, llava_config_to_hf, read_llava_file
from tessera.data.image_processor import ImageProcessor
from tessera.models.vision.llava import Llava

_LEGACY = ((r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
           (r"^language_model\.", "model.language_model."), (r"^vision_tower\.", "model.vision_tower."),
           (r"^multi_modal_projector\.", "model.multi_modal_projector."),
           (r"^model\.vision_tower\.vision_model\.", "model.vision_tower."))
_BLOCK = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attention.wq": "self_attn.q_proj",
          "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.out_proj",
          "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def current_name(name: str) -> str:
    """A stored tensor name in transformers 5's layout (llava-hf's older names rewritten)."""
    for pattern, repl in _LEGACY:
        name = re.sub(pattern, repl, name)
    return name


def saved_name(name: str) -> str:
    """A tensor name of transformers 5's layout as its `save_pretrained` writes it (the language model
    and the head under `language_model.`, the tower and projector without the `model.` prefix)."""
    for current, saved in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                           ("model.vision_tower.", "vision_tower."),
                           ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(current):
            return saved + name[len(current):]
    return name


def is_llava_directory(path: str | os.PathLike) -> bool:
    return config_says(path, is_llava_config)


def vision_names(v: VisionConfig, prefix: str = "model.vision_tower.") -> dict[str, str]:
    """Tessera vision-tower key -> HuggingFace key (CLIP's / SigLIP's vision model), in model order."""
    emb = f"{prefix}embeddings."
    names = {"patch_embedding.weight": f"{emb}patch_embedding.weight"}
    if v.kind == "siglip":
        names["patch_embedding.bias"] = f"{emb}patch_embedding.bias"
    else:
        names["class_embedding"] = f"{emb}class_embedding"
    names["position_embedding.weight"] = f"{emb}position_embedding.weight"
    if v.kind == "clip":
        names.update({f"pre_norm.{p}": f"{prefix}pre_layrnorm.{p}" for p in ("weight", "bias")})
    for i in range(v.n_layers):
        for mine, theirs in _BLOCK.items():
            for p in ("weight", "bias"):
                names[f"layers.{i}.{mine}.{p}"] = f"{prefix}encoder.layers.{i}.{theirs}.{p}"
    names.update({f"post_norm.{p}": f"{prefix}post_layernorm.{p}" for p in ("weight", "bias")})
    if v.use_head:
        head = ["probe", "attention.in_proj_weight", "attention.in_proj_bias", "attention.out_proj.weight",
                "attention.out_proj.bias", "layernorm.weight", "layernorm.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                "mlp.fc2.weight", "mlp.fc2.bias"]
        names.update({f"head.{n}": f"{prefix}head.{n}" for n in head})
    return {f"vision_tower.{k}": h for k, h in names.items()}


def llava_names(cfg: LlavaConfig) -> dict[str, list[str]]:
    """Tessera `Llava` key -> HuggingFace key(s) (transformers 5's layout), in model order; routed
    experts are one Tessera tensor and E HuggingFace ones, as in `hf_names`."""
    names = {k: [h] for k, h in vision_names(cfg.vision).items()}
    for p in ("linear_1", "linear_2"):
        names[f"projector.{p}.weight"] = [f"model.multi_modal_projector.{p}.weight"]
        if cfg.projector_bias:
            names[f"projector.{p}.bias"] = [f"model.multi_modal_projector.{p}.bias"]
    for key, hf_keys in hf_names(cfg.text).items():
        names[f"language_model.{key}"] = [_in_llava(h) for h in hf_keys]
    return names


def _in_llava(hf_key: str) -> str:
    """A language model's HuggingFace key as LLaVA's current layout names it."""
    return hf_key if hf_key == "lm_head.weight" else re.sub(r"^model\.", "model.language_model.", hf_key)


def language_model_names(names: dict[str, list[str]], stored: set[str]) -> tuple[dict[str, list[str]], set[str]]:
    """A language model's Tessera -> HuggingFace names (`hf_names`) as a LLaVA directory holding
    `stored` names them (either layout), and the stored keys that are not the language model's
    (the vision tower and projector: a text run reads none of them)."""
    lookup = {current_name(k): k for k in stored}
    out = {key: [lookup.get(_in_llava(h), _in_llava(h)) for h in hs] for key, hs in names.items()}
    used = {h for hs in out.values() for h in hs}
    return out, {k for k in stored if k not in used}


def _exportable(cfg: LlavaConfig) -> None:
    check_exportable(cfg.text)


DIRECTORY = DirectoryFormat(read_llava_file, llava_config_to_hf, Llava, ImageProcessor, llava_names, current_name,
                            saved_name, language_model_names, _exportable)
load_llava = DIRECTORY.load  # (path, dtype, device) -> the directory's `Llava`, in eval mode
save_llava = DIRECTORY.save  # (model, path, tokenizer=, processor=, max_shard_bytes=): a LLaVA directory written
