"""`train.vision_language`: supervised fine-tuning of a vision-language model (LLaVA, Qwen2-VL or
Qwen2.5-VL) on image-text conversations (`data.kind=vision_sft`, tessera.data.vision_sft).

    tessera train configs/tiny-llava.yaml
    tessera train configs/tiny-qwen2-vl.yaml

The model is `family`'s (tessera.models.vision.llava, tessera.models.vision.qwen_vl): the `model` section is its
language model (a qwen2 decoder for the Qwen families), this section the image side. With
`train.init_from` a LLaVA / Qwen2-VL / Qwen2.5-VL HuggingFace directory or a Tessera
vision-language checkpoint (what `tessera convert` writes from one, or a run of this kind) the
family, tower, projector, special tokens and image processor are that source's and the fields
here that describe them are not used (Qwen's `min_pixels` / `max_pixels` still apply: they change
the preprocessing, not the weights); the freeze switches always apply. A frozen part's parameters
get no gradient and no optimizer state, so they stay bit-identical through training. For the Qwen
families the projector is the tower's patch merger, and `freeze_vision_tower` the rest of the tower.

LLaVA, Qwen2-VL and Qwen2.5-VL train in one process and under every layout of their language model
(tessera.parallel.vision_language): data parallelism (dp_replicate, dp_shard: FSDP over the
language model's blocks, the tower, projector, embeddings and head in the root's unit; or
parallel.optimizer=distributed), tensor parallelism with or without parallel.sp (the tower and
projector replicated on the tp ranks, the image rows merged before the sequence is cut), context
parallelism (each cp rank encodes the micro-batch's images and keeps its chunk's rows), expert
parallelism of an MoE language model, and pipeline parallelism (the tower and projector on the
first stage, which alone gets the images). Qwen's M-RoPE positions are computed from the whole rows
and their grids, and each rank keeps its tokens' positions: its cp chunk's (whole under sp, as the
language model's RoPE takes them), and under pp every stage is handed its rows' positions
(tessera.models.vision.qwen_vl). Expert parallelism is refused by name for Qwen2-VL / Qwen2.5-VL (their
family's `refuse_layouts`, tessera/config/vision_families.py, also when the family comes from
train.init_from): their language model is a dense qwen2 decoder, which has no routed experts to
split. Distillation, EAGLE, FP8, compile, recomputation, activation offload and multi-token
prediction are refused by name for every family.
Checkpoints and `--resume` work, also across layouts; `checkpoint.export_hf` and `tessera convert
RUN OUT` write a LLaVA / Qwen2-VL / Qwen2.5-VL directory transformers loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import require
from tessera.config.qwen_vl import QwenVisionConfig
from tessera.config.vision import ACTIVATIONS, STRATEGIES, VisionConfig
from tessera.config.vision_families import REGISTRY

DATA_KIND = "vision_sft"
FAMILIES = tuple(REGISTRY)  # llava, qwen2_vl, qwen2_5_vl, qwen3_5, qwen3_5_moe (tessera/config/vision_families.py)


def _tiny_tower() -> VisionConfig:
    # a small CLIP tower: 16x16 images in 4x4 patches -> 16 image tokens each (select_strategy=default)
    return VisionConfig(kind="clip", image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=2, ffn_dim=64)


def _tiny_qwen_tower() -> QwenVisionConfig:
    # a small native-resolution tower: 4x4 patches, 2x2 merged, so a 16x16 image takes 4 tokens
    return QwenVisionConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64, patch_size=4, window_size=16)


@dataclass
class VisionLanguageTrainConfig:
    """The vision side of a `data.kind=vision_sft` run, and what of the model trains."""

    # The model built from train.seed when train.init_from holds none: llava (`tower` and the
    # projector fields below), qwen2_vl or qwen2_5_vl (`qwen_tower`, the vision tokens, mrope_section).
    family: str = "llava"
    # The vision tower built from train.seed when there is no LLaVA source in train.init_from (a
    # CLIP or SigLIP ViT: tessera.config.vision.VisionConfig's fields). The image processor is the
    # one such a tower ships with (resize and crop to tower.image_size, CLIP's or SigLIP's statistics).
    tower: VisionConfig = field(default_factory=_tiny_tower)
    # The placeholder token each image's features replace; None = the language model's last id
    # (model.vocab_size - 1), which a tokenizer smaller than the vocabulary never writes.
    image_token_id: int | None = None
    # Hidden states of the tower fed to the projector: indices into (embeddings, layer 1, ..., layer n),
    # negative from the end; several are concatenated. LLaVA-1.5 reads the second-to-last layer.
    feature_layer: list[int] = field(default_factory=lambda: [-2])
    select_strategy: str = "default"  # default: drop the first token (CLIP's class token); full: keep all
    projector_act: str = "gelu"  # between the projector's two linear layers (one of ACTIVATIONS)
    # Qwen2-VL / Qwen2.5-VL built from train.seed: the native-resolution tower (QwenVisionConfig's
    # fields; its version is `family` and its out_dim the model's dim, both set here).
    qwen_tower: QwenVisionConfig = field(default_factory=_tiny_qwen_tower)
    # The tokens Qwen's chat template writes around each image's placeholders; None = the language
    # model's third-to-last and second-to-last ids (the video token, written to config.json only,
    # is the fourth-to-last).
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # M-RoPE's rotary pairs per (temporal, height, width) coordinate, summing to head_dim / 2; None =
    # Qwen's proportions (1/4, 3/8, 3/8: [16, 24, 24] for head_dim 128).
    mrope_section: list[int] | None = None
    # Qwen's image processor's pixel range (smart_resize keeps an image's area within it, so it
    # bounds each image's tokens: area / (patch_size x merge)^2); None = the source's processor's,
    # else Qwen's defaults (56 x 56 and 28 x 28 x 1280). Used with train.init_from too.
    min_pixels: int | None = None
    max_pixels: int | None = None
    freeze_vision_tower: bool = False  # the tower gets no gradient and no optimizer state (Qwen: all but the merger)
    freeze_projector: bool = False  # the projector likewise (Qwen: the patch merger)
    freeze_language_model: bool = False  # the language model likewise (its embeddings and head included)


def validate_vision_language(cfg: Any) -> None:
    """Checks across sections for a `data.kind=vision_sft` run (the layout is checked at start-up)."""
    v, t, p = cfg.train.vision_language, cfg.train, cfg.parallel
    if cfg.data.kind != DATA_KIND:
        return
    require(v.family in FAMILIES, "train.vision_language.family", v.family, f"one of {', '.join(FAMILIES)}")
    for key in ("min_pixels", "max_pixels"):
        require(getattr(v, key) is None or getattr(v, key) > 0, f"train.vision_language.{key}", getattr(v, key),
                "null or a positive number of pixels")
    if v.min_pixels is not None and v.max_pixels is not None:
        require(v.min_pixels <= v.max_pixels, "train.vision_language.min_pixels", v.min_pixels,
                f"at most max_pixels={v.max_pixels}")
    require(v.select_strategy in STRATEGIES, "train.vision_language.select_strategy", v.select_strategy,
            f"one of {', '.join(STRATEGIES)}")
    require(v.projector_act in ACTIVATIONS, "train.vision_language.projector_act", v.projector_act,
            f"one of {', '.join(ACTIVATIONS)}")
    require(not (v.freeze_vision_tower and v.freeze_projector and v.freeze_language_model),
            "train.vision_language.freeze_language_model", True,
            "at most two of freeze_vision_tower, freeze_projector, freeze_language_model (nothing would train)")
    what = "vision-language fine-tuning (data.kind=vision_sft)"
    REGISTRY[v.family].refuse_layouts(p)
    require(t.distill.teacher is None, "train.distill.teacher", t.distill.teacher, f"null with {what}")
    require(t.eagle.target is None, "train.eagle.target", t.eagle.target, f"null with {what}")
    require(not t.fp8, "train.fp8", t.fp8, f"false with {what}")
    require(t.compile is not True, "train.compile", t.compile, f"null or false with {what}")
    require(p.recompute == "none", "parallel.recompute", p.recompute, f"none with {what}")
    require(not p.activation_offload, "parallel.activation_offload", p.activation_offload, f"false with {what}")
    require(cfg.model.mtp_depth == 0, "model.mtp_depth", cfg.model.mtp_depth, f"0 with {what}")
    for i, entry in enumerate(cfg.data.datasets):
        require(entry.weight == 1.0, f"data.datasets[{i}].weight", entry.weight,
                f"1.0 with {what} (the JSONL files' records are read in turn, not blended)")

