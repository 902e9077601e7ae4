"""The model side of a vision-language fine-tune (`data.kind=vision_sft`, tessera.config.training.vision_training).

    model_cfg, processor = vision_model_config(cfg)     # from train.init_from's model, else the config
    model = build_vision_model(cfg, device, init_from)  # its family's model, its frozen parts frozen

What differs by family comes from the family, never from a test for one here: its config from
train.vision_language (tessera/config/vision_families.py), its model class, image processor and
HuggingFace directory (tessera/checkpoint/vision_families.py), and the modules the freeze switches
name (`VisionLanguageModel.part_modules`).

The model is built whole on every rank (no meta-device build: each rank holds the whole model
until the layout cuts it), then cut by the layout (tessera.train.builder, through
tessera.parallel.vision_language): every layout of the language model (dp_replicate, dp_shard, tp
with or without sp, cp, pp, and ep of an MoE language model, which Qwen2-VL / Qwen2.5-VL's dense
qwen2 decoder is not: tessera.config.training.vision_training refuses it), the tower and projector beside
it and on the first pipeline stage only. The step engines need little of their own for it:
each rank's images (`rank_images`, and for Qwen2-VL / Qwen2.5-VL their patch grids,
`rank_image_grids`): a batch's `pixel_values` reach `Llava.forward(input_ids, pixel_values=...,
targets=...)` or `QwenVL.forward(input_ids, pixel_values=..., image_grid_thw=..., targets=...)`
(step_engine.accumulate_micro_batches; under pp the first stage's, one micro-batch's rows at a
time: pipeline_step.PipelineStep), which encodes the images and puts their features at the image
placeholders; QwenVL computes each row's M-RoPE positions from the grids there, on the whole rows
(gathered from the cp chunks), the function its parity with transformers rests on
(`mrope_positions`), so training runs the positions serving and transformers use. Under pp every
stage needs them but only the first receives ids: each rank computes its rows' positions from the
batch (`rank_row_positions`) and the pipeline hands them to all its stages. A checkpoint's
meta.json holds the model's HuggingFace config and image processor (`vision_language_entry`, the
entry tessera.checkpoint.dcp.vision_language reads), so `tessera convert` and
`checkpoint.export_hf` write a LLaVA / Qwen2-VL / Qwen2.5-VL directory from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.checkpoint.vision_families import (
    REGISTRY,
    default_processor,
    is_vision_language_directory,
    read_directory_model_config,
    read_directory_processor,
)
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import model_differences
from tessera.config.schema import RunConfig
from tessera.config.training.vision_training import DATA_KIND
from tessera.config.vision_families import REGISTRY as CONFIG_REGISTRY
from tessera.config.vision_families import vision_language_config_to_hf
from tessera.data.batching import Batch
from tessera.models.vision.vision_language import VisionLanguageModel
from tessera.parallel.data_parallel_batch import dp_rows, sequence_chunk
from tessera.parallel.dims import ParallelDims

FROZEN_PARTS = {"freeze_vision_tower": "vision_tower", "freeze_projector": "projector",
                "freeze_language_model": "language_model"}


def is_vision_run(cfg: RunConfig) -> bool:
    return cfg.data.kind == DATA_KIND


def _source(cfg: RunConfig) -> str | None:
    """"directory" (a vision-language family's HuggingFace directory) or "checkpoint" when
    train.init_from holds a whole vision-language model, else None."""
    from tessera.checkpoint.dcp.vision_language import is_vision_language_checkpoint

    path = cfg.train.init_from
    if path is None:
        return None
    if is_vision_language_directory(path):
        return "directory"
    if is_vision_language_checkpoint(path):
        return "checkpoint"
    raise ConfigError(f"train.init_from={path!r} is invalid with data.kind={DATA_KIND}: a LLaVA, Qwen2-VL, "
                      "Qwen2.5-VL or Qwen3.5 HuggingFace directory or a Tessera vision-language checkpoint (tessera "
                      "convert MODEL_DIR OUT writes one); null: the model train.vision_language.family names, built "
                      "from train.seed")


def vision_model_config(cfg: RunConfig) -> tuple[Any, Any]:
    """The model to train (its family's config) and its image processor: train.init_from's, else
    train.vision_language's family over the `model` section's language model; the processor within
    train.vision_language's min_pixels / max_pixels where they are set (Qwen's only)."""
    source = _source(cfg)
    if source is None:
        model_cfg = CONFIG_REGISTRY[cfg.train.vision_language.family].from_section(cfg.train.vision_language,
                                                                                   cfg.model)
        return model_cfg, _pixel_range(cfg, default_processor(model_cfg))
    if source == "directory":
        model_cfg = read_directory_model_config(cfg.train.init_from)
        processor = read_directory_processor(cfg.train.init_from, model_cfg)
    else:
        from tessera.checkpoint.dcp import store as ckpt
        from tessera.checkpoint.dcp.vision_language import read_vision_language_entry

        model_cfg, processor = read_vision_language_entry(ckpt.resolve_checkpoint(cfg.train.init_from))
    CONFIG_REGISTRY[model_cfg.family].refuse_layouts(cfg.parallel)  # the family comes from the source
    differences = model_differences(cfg.model, model_cfg.text, shapes_only=True)
    if differences:
        raise ConfigError(f"the model section differs from train.init_from={cfg.train.init_from!r}'s language model in "
                          f"{', '.join(differences[:4])}: leave the model section empty to take the source's")
    return model_cfg, _pixel_range(cfg, processor)


def _pixel_range(cfg: RunConfig, processor: Any) -> Any:
    """`processor` with train.vision_language's min_pixels / max_pixels (Qwen's processors only)."""
    v = cfg.train.vision_language
    if v.min_pixels is None and v.max_pixels is None:
        return processor
    return processor.with_pixel_range(v.min_pixels, v.max_pixels, "train.vision_language")


def build_vision_model(cfg: RunConfig, device: torch.device, init_from: str | None) -> VisionLanguageModel:
    """The model of `cfg` on `device` in train mode: read from `init_from` (the start of a run; None
    when resuming, where the checkpoint fills it) or initialised from train.seed; then the parts
    the freeze switches name stop requiring gradients (so the optimizer holds no state for them),
    and so do the tower's modules no forward runs (they could get no gradient)."""
    model_cfg, _ = vision_model_config(cfg)
    directory = REGISTRY[model_cfg.family].directory
    if init_from is None:
        model = directory.model(model_cfg, init_seed=cfg.train.seed).to(device)
    elif _source(cfg) == "directory":
        model = directory.load(init_from, torch.float32, device)
    else:
        from tessera.checkpoint.dcp.vision_language import load_vision_language_checkpoint

        model, _, _ = load_vision_language_checkpoint(init_from, torch.float32, device)
    if model.cfg != model_cfg:
        raise CheckpointError(f"train.init_from={init_from!r} holds another model than its config describes")
    for switch, part in FROZEN_PARTS.items():
        if getattr(cfg.train.vision_language, switch):
            for module in model.part_modules(part):
                module.requires_grad_(False)
    for module in unused_tower_modules(model):
        module.requires_grad_(False)
    return model.train()


def unused_tower_modules(model: VisionLanguageModel) -> list[nn.Module]:
    """The tower's modules the model never runs (`VisionLanguageModel.unused_tower_modules`: LLaVA's
    blocks past the deepest feature layer and final LayerNorm; Qwen runs its whole tower)."""
    return model.unused_tower_modules()


def rank_images(batch: Batch, dims: ParallelDims | None) -> list[torch.Tensor] | None:
    """This rank's rows' images of a vision-language batch (None for text), as `shard_global_batch`
    takes its rows."""
    if batch.pixel_values is None or dims is None:
        return batch.pixel_values
    return batch.pixel_values[dp_rows(len(batch.pixel_values), dims)]


def rank_image_grids(batch: Batch, dims: ParallelDims | None) -> list[torch.Tensor] | None:
    """This rank's rows' image grids (Qwen2-VL / Qwen2.5-VL; None otherwise), as `rank_images`."""
    if batch.image_grid_thw is None or dims is None:
        return batch.image_grid_thw
    return batch.image_grid_thw[dp_rows(len(batch.image_grid_thw), dims)]


def rank_row_positions(model: nn.Module, batch: Batch, dims: ParallelDims) -> torch.Tensor | None:
    """A pipeline rank's rotary positions of its tokens when the model computes its own from the
    whole rows (Qwen2-VL / Qwen2.5-VL's M-RoPE; None otherwise): `mrope_positions` of its rows'
    ids and grids, whole, then its cp chunk of them, in the order it holds its tokens, rows first
    [B, 3, C] (`QwenVL.forward`'s `row_positions`). Every rank holds the global batch, so no stage
    waits for another's: the later stages, which receive hidden states, rotate by the same
    positions as the first, which receives the ids. `model` is one of this rank's stages."""
    if batch.image_grid_thw is None:
        return None
    ids = batch.inputs[dp_rows(batch.inputs.shape[0], dims)]
    positions = model.rope_positions(ids, torch.cat(rank_image_grids(batch, dims)))  # [3, B, S]
    if positions is None:  # the family's positions are the language model's own
        return None
    return sequence_chunk(positions.transpose(0, 1), dims, dim=2).contiguous()


def vision_language_entry(cfg: RunConfig) -> dict:
    """meta.json's `vision_language` entry of a checkpoint of this run: the model's config.json (its
    model_type says the family), the image processor and the tokenizer an export writes
    (data.tokenizer, the bundled one when unset)."""
    model_cfg, processor = vision_model_config(cfg)
    return {"config": vision_language_config_to_hf(model_cfg), "processor": processor.to_dict(),
            "tokenizer": cfg.data.tokenizer or "default"}
