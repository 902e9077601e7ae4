"""Qwen3.5 / Qwen3.5-MoE HuggingFace directories (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): read, checked, loaded, written.

    model = load_qwen3_5_vl("qwen3.5-dir", dtype=torch.float32)   # a tessera.models.vision.qwen3_vision.Qwen35VL
    save_qwen3_5_vl(model, "out/", tokenizer=..., processor=...)  # AutoModelForImageTextToText loads it

Files hold transformers 5's in-memory layout (`model.language_model.*`, `model.visual.*`,
`lm_head.weight`), which is also what its `save_pretrained` writes; Qwen2-VL's older spelling
(`model.layers.*`, `visual.*`) is read too (hf/qwen_vl.py's `current_name`). The language model's
names come from its text family, routed experts one tensor per expert as the published files and
`save_pretrained` hold them (`hf_unpacked`); the multi-token-prediction layers (`mtp.*`) are left
unread, as transformers leaves them. The image processor is Qwen2-VL's (preprocessor_config.json).
"""

from __future__ import annotations

from tessera.checkpoint.hf.composite import DirectoryFormat
from tessera.checkpoint.hf.names import hf_names, hf_unpacked, unread
from tessera.checkpoint.hf.qwen_vl import current_name, language_model_names
from tessera.config.qwen3_5_vl import qwen3_5_vl_config_to_hf, read_qwen3_5_vl_file
from tessera.config.qwen_vl import QwenVisionConfig, QwenVLConfig
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.models.vision.qwen3_vision import Qwen35VL


def vision_names(v: QwenVisionConfig) -> dict[str, list[str]]:
    """Tessera vision-tower key -> HuggingFace key, in model order."""
    pre = "model.visual."
    both = ("weight", "bias")
    names = {f"patch_embed.{p}": f"{pre}patch_embed.proj.{p}" for p in both}
    names["pos_embed.weight"] = f"{pre}pos_embed.weight"
    for i in range(v.n_layers):
        mine, theirs = f"layers.{i}.", f"{pre}blocks.{i}."
        for a, b in (("norm1", "norm1"), ("attention.wqkv", "attn.qkv"), ("attention.wo", "attn.proj"),
                     ("norm2", "norm2"), ("mlp.fc1", "mlp.linear_fc1"), ("mlp.fc2", "mlp.linear_fc2")):
            names.update({f"{mine}{a}.{p}": f"{theirs}{b}.{p}" for p in both})
    for a, b in (("norm", "norm"), ("linear_1", "linear_fc1"), ("linear_2", "linear_fc2")):
        names.update({f"merger.{a}.{p}": f"{pre}merger.{b}.{p}" for p in both})
    return {f"vision_tower.{k}": [h] for k, h in names.items()}


def _in_memory(hf_key: str) -> str:
    return hf_key if hf_key == "lm_head.weight" else hf_key.replace("model.", "model.language_model.", 1)


def qwen3_5_vl_names(cfg: QwenVLConfig) -> dict[str, list[str]]:
    """Tessera `Qwen35VL` key -> HuggingFace key(s) (in-memory layout; routed experts one per expert)."""
    names = vision_names(cfg.vision)
    text = {**hf_names(cfg.text), **hf_unpacked(cfg.text)}
    names.update({f"language_model.{k}": [_in_memory(h) for h in hs] for k, hs in text.items()})
    return names


def _unread(cfg: QwenVLConfig, key: str) -> bool:
    """The stored tensors the language model leaves unread (its family's: `mtp.*`)."""
    return unread(cfg.text, key)


def _saved(name: str) -> str:
    return name  # the files hold the in-memory layout


DIRECTORY = DirectoryFormat(read_qwen3_5_vl_file, qwen3_5_vl_config_to_hf, Qwen35VL, QwenImageProcessor,
                            qwen3_5_vl_names, current_name, _saved, language_model_names, unread=_unread)
load_qwen3_5_vl = DIRECTORY.load  # (path, dtype, device) -> the directory's `Qwen35VL`, in eval mode
save_qwen3_5_vl = DIRECTORY.save  # (model, path, tokenizer=, processor=, max_shard_bytes=): its directory written
