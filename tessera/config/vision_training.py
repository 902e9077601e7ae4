"""`train.vision_language`: supervised fine-tuning of a vision-language model (LLaVA) on image-text
conversations (`data.kind=vision_sft`, tessera.data.vision_sft).

    tessera train configs/tiny-llava.yaml

The model is LLaVA (tessera.models.llava): the `model` section is its language model, this
section its vision tower and projector. With `train.init_from` a LLaVA HuggingFace directory or a
Tessera vision-language checkpoint (what `tessera convert` writes from one, or a run of this kind)
the tower, projector, image token and image processor are that source's and `tower`,
`image_token_id`, `feature_layer`, `select_strategy` and `projector_act` here are not used; the
freeze switches always apply. A frozen part's parameters get no gradient and no optimizer state,
so they stay bit-identical through training.

One process and every layout of the language model (tessera.parallel.vision_language): data
parallelism (dp_replicate, dp_shard: FSDP over the language model's blocks, the tower, projector,
embeddings and head in the root's unit; or parallel.optimizer=distributed), tensor parallelism with
or without parallel.sp (the tower and projector replicated on the tp ranks, the image rows merged
before the sequence is cut), context parallelism (each cp rank encodes the micro-batch's images and
keeps its chunk's rows), expert parallelism of an MoE language model, and pipeline parallelism (the
tower and projector on the first stage, which alone gets the images). Distillation, EAGLE, FP8,
compile, recomputation, activation offload and multi-token prediction are refused by name.
Checkpoints and `--resume` work, also across layouts; `checkpoint.export_hf` and
`tessera convert RUN OUT` write a LLaVA directory transformers loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.config.vision import ACTIVATIONS, STRATEGIES, VisionConfig

DATA_KIND = "vision_sft"


def _tiny_tower() -> VisionConfig:
    # a small CLIP tower: 16x16 images in 4x4 patches -> 16 image tokens each (select_strategy=default)
    return VisionConfig(kind="clip", image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=2, ffn_dim=64)


@dataclass
class VisionLanguageTrainConfig:
    """The vision side of a `data.kind=vision_sft` run, and what of the model trains."""

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
    freeze_vision_tower: bool = False  # the tower gets no gradient and no optimizer state
    freeze_projector: bool = False  # the projector likewise
    freeze_language_model: bool = False  # the language model likewise (its embeddings and head included)


def validate_vision_language(cfg: Any, need: Any) -> None:
    """Checks across sections for a `data.kind=vision_sft` run (the layout is checked at start-up)."""
    v, t, p = cfg.train.vision_language, cfg.train, cfg.parallel
    if cfg.data.kind != DATA_KIND:
        return
    need(v.select_strategy in STRATEGIES, "train.vision_language.select_strategy", v.select_strategy,
         f"one of {', '.join(STRATEGIES)}")
    need(v.projector_act in ACTIVATIONS, "train.vision_language.projector_act", v.projector_act,
         f"one of {', '.join(ACTIVATIONS)}")
    need(not (v.freeze_vision_tower and v.freeze_projector and v.freeze_language_model),
         "train.vision_language.freeze_language_model", True,
         "at most two of freeze_vision_tower, freeze_projector, freeze_language_model (nothing would train)")
    what = "vision-language fine-tuning (data.kind=vision_sft)"
    need(t.distill.teacher is None, "train.distill.teacher", t.distill.teacher, f"null with {what}")
    need(t.eagle.target is None, "train.eagle.target", t.eagle.target, f"null with {what}")
    need(not t.fp8, "train.fp8", t.fp8, f"false with {what}")
    need(t.compile is not True, "train.compile", t.compile, f"null or false with {what}")
    need(p.recompute == "none", "parallel.recompute", p.recompute, f"none with {what}")
    need(not p.activation_offload, "parallel.activation_offload", p.activation_offload, f"false with {what}")
    need(cfg.model.mtp_depth == 0, "model.mtp_depth", cfg.model.mtp_depth, f"0 with {what}")
    for i, entry in enumerate(cfg.data.datasets):
        need(entry.weight == 1.0, f"data.datasets[{i}].weight", entry.weight,
             f"1.0 with {what} (the JSONL files' records are read in turn, not blended)")
