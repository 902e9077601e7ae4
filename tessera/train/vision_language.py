"""The model side of a vision-language fine-tune (`data.kind=vision_sft`, tessera.config.vision_training).

    model_cfg, processor = vision_model_config(cfg)     # from train.init_from's model, else the config
    model = build_vision_model(cfg, device, init_from)  # a Llava or QwenVL, its frozen parts frozen

The model is built whole on every rank (no meta-device build: each rank holds the whole model
until the layout cuts it), then cut by the layout (tessera.train.builder, through
tessera.parallel.vision_language): every layout of the language model (dp_replicate, dp_shard, tp
with or without sp, cp, pp, and ep of an MoE language model, which Qwen2-VL / Qwen2.5-VL's dense
qwen2 decoder is not: tessera.config.vision_training refuses it), the tower and projector beside
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

from dataclasses import replace

import torch
from torch import nn

from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import model_differences
from tessera.config.qwen_vl import (
    QwenVLConfig,
    default_mrope_section,
    is_qwen_vl_config,
    qwen_vl_config_from_hf,
    qwen_vl_config_to_hf,
)
from tessera.config.schema import RunConfig
from tessera.config.vision import LlavaConfig, llava_config_from_hf, llava_config_to_hf
from tessera.config.vision_training import DATA_KIND, refuse_qwen_layouts
from tessera.data.batching import Batch
from tessera.data.image_processor import ImageProcessor
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.models.llava import Llava
from tessera.models.qwen_vl import QwenVL
from tessera.parallel.data_parallel_batch import dp_rows, sequence_chunk
from tessera.parallel.dims import ParallelDims

FROZEN_PARTS = {"freeze_vision_tower": "vision_tower", "freeze_projector": "projector",
                "freeze_language_model": "language_model"}

VisionModelConfig = LlavaConfig | QwenVLConfig
Processor = ImageProcessor | QwenImageProcessor


def is_vision_run(cfg: RunConfig) -> bool:
    return cfg.data.kind == DATA_KIND


def _source(cfg: RunConfig) -> str | None:
    """"llava" or "qwen_vl" (a HuggingFace directory) or "checkpoint" when train.init_from holds a
    whole vision-language model, else None."""
    from tessera.checkpoint.dcp.vision_language import is_vision_language_checkpoint
    from tessera.checkpoint.hf.llava import is_llava_directory
    from tessera.checkpoint.hf.qwen_vl import is_qwen_vl_directory

    path = cfg.train.init_from
    if path is None:
        return None
    if is_llava_directory(path):
        return "llava"
    if is_qwen_vl_directory(path):
        return "qwen_vl"
    if is_vision_language_checkpoint(path):
        return "checkpoint"
    raise ConfigError(f"train.init_from={path!r} is invalid with data.kind={DATA_KIND}: a LLaVA, Qwen2-VL or "
                      "Qwen2.5-VL HuggingFace directory or a Tessera vision-language checkpoint (tessera convert "
                      "MODEL_DIR OUT writes one); null: the model train.vision_language.family names, built from "
                      "train.seed")


def vision_model_config(cfg: RunConfig) -> tuple[VisionModelConfig, Processor]:
    """The model to train and its image processor: train.init_from's, else train.vision_language's
    family over the `model` section's language model; Qwen's processor within train.vision_language's
    min_pixels / max_pixels where they are set."""
    source = _source(cfg)
    if source == "llava":
        from tessera.checkpoint.hf.llava import read_llava_config, read_processor

        model_cfg = read_llava_config(cfg.train.init_from)
        processor = read_processor(cfg.train.init_from, model_cfg)
    elif source == "qwen_vl":
        from tessera.checkpoint.hf import qwen_vl

        model_cfg = qwen_vl.read_qwen_vl_config(cfg.train.init_from)
        processor = qwen_vl.read_processor(cfg.train.init_from, model_cfg)
    elif source == "checkpoint":
        from tessera.checkpoint.dcp import store as ckpt
        from tessera.checkpoint.dcp.vision_language import ENTRY

        found = ckpt.resolve_checkpoint(cfg.train.init_from)
        entry = ckpt.read_meta(found)[ENTRY]
        qwen = is_qwen_vl_config(entry["config"])
        model_cfg = (qwen_vl_config_from_hf if qwen else llava_config_from_hf)(entry["config"])
        processor = (QwenImageProcessor if qwen else ImageProcessor).from_dict(entry["processor"],
                                                                              f"{found}/meta.json")
    elif cfg.train.vision_language.family == "llava":
        return _llava_from_config(cfg), _pixel_range(cfg, ImageProcessor.for_vision(cfg.train.vision_language.tower))
    else:
        model_cfg = _qwen_from_config(cfg)
        return model_cfg, _pixel_range(cfg, QwenImageProcessor.for_vision(model_cfg.vision))
    if isinstance(model_cfg, QwenVLConfig):  # the family comes from the source: its layouts checked here
        refuse_qwen_layouts(cfg.parallel)
    differences = model_differences(cfg.model, model_cfg.text, shapes_only=True)
    if differences:
        raise ConfigError(f"the model section differs from train.init_from={cfg.train.init_from!r}'s language model in "
                          f"{', '.join(differences[:4])}: leave the model section empty to take the source's")
    return model_cfg, _pixel_range(cfg, processor)


def _llava_from_config(cfg: RunConfig) -> LlavaConfig:
    v = cfg.train.vision_language
    token = v.image_token_id if v.image_token_id is not None else cfg.model.vocab_size - 1
    layers = v.feature_layer[0] if len(v.feature_layer) == 1 else list(v.feature_layer)
    try:
        return LlavaConfig(text=cfg.model, vision=v.tower, image_token_id=token, feature_layer=layers,
                           select_strategy=v.select_strategy, projector_act=v.projector_act)
    except ConfigError as e:
        raise ConfigError(f"train.vision_language: {e}") from e


def _qwen_from_config(cfg: RunConfig) -> QwenVLConfig:
    """train.vision_language's Qwen2-VL / Qwen2.5-VL over the `model` section (a qwen2 decoder): its
    special tokens the vocabulary's last ids unless given, the tower's output the model's width."""
    v, vocab = cfg.train.vision_language, cfg.model.vocab_size
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
    section = list(v.mrope_section) if v.mrope_section is not None else default_mrope_section(cfg.model.head_dim)
    try:
        return QwenVLConfig(text=cfg.model, vision=replace(v.qwen_tower, version=v.family, out_dim=cfg.model.dim),
                            mrope_section=section, **tokens)
    except ConfigError as e:
        raise ConfigError(f"train.vision_language: {e}") from e


def _pixel_range(cfg: RunConfig, processor: Processor) -> Processor:
    """`processor` with train.vision_language's min_pixels / max_pixels (Qwen's processors only)."""
    v = cfg.train.vision_language
    if v.min_pixels is None and v.max_pixels is None:
        return processor
    if not isinstance(processor, QwenImageProcessor):
        raise ConfigError("train.vision_language.min_pixels / max_pixels apply to Qwen2-VL / Qwen2.5-VL models; "
                          "LLaVA's processor resizes every image to the tower's size: leave them null")
    size = {"shortest_edge": v.min_pixels or processor.min_pixels, "longest_edge": v.max_pixels or processor.max_pixels}
    out = replace(processor, size=size)
    out.check("train.vision_language (min_pixels, max_pixels)")
    return out


def build_vision_model(cfg: RunConfig, device: torch.device, init_from: str | None) -> Llava | QwenVL:
    """The model of `cfg` on `device` in train mode: read from `init_from` (the start of a run; None
    when resuming, where the checkpoint fills it) or initialised from train.seed; then the parts
    the freeze switches name stop requiring gradients (so the optimizer holds no state for them)."""
    model_cfg, _ = vision_model_config(cfg)
    source = _source(cfg)
    if init_from is None:
        family = QwenVL if isinstance(model_cfg, QwenVLConfig) else Llava
        model = family(model_cfg, init_seed=cfg.train.seed).to(device)
    elif source == "llava":
        from tessera.checkpoint.hf.llava import load_llava

        model = load_llava(init_from, torch.float32, device)
    elif source == "qwen_vl":
        from tessera.checkpoint.hf.qwen_vl import load_qwen_vl

        model = load_qwen_vl(init_from, torch.float32, device)
    else:
        from tessera.checkpoint.dcp.vision_language import load_vision_language_checkpoint

        model, _, _ = load_vision_language_checkpoint(init_from, torch.float32, device)
    if model.cfg != model_cfg:
        raise CheckpointError(f"train.init_from={init_from!r} holds another model than its config describes")
    for switch, part in FROZEN_PARTS.items():
        if getattr(cfg.train.vision_language, switch):
            for module in part_modules(model, part):
                module.requires_grad_(False)
    for module in unused_tower_modules(model):
        module.requires_grad_(False)
    return model.train()


def part_modules(model: Llava | QwenVL, part: str) -> list[nn.Module]:
    """The modules of `part` (a FROZEN_PARTS value). LLaVA's are its attributes of that name; Qwen's
    projector is the tower's patch merger (what maps the tower's features into the language model's
    width, as LLaVA's projector does), so its vision_tower is the rest of the tower."""
    if isinstance(model, QwenVL):
        tower = model.vision_tower
        return {"vision_tower": [tower.patch_embed, tower.layers], "projector": [tower.merger],
                "language_model": [model.language_model]}[part]
    return [getattr(model, part)]


def unused_tower_modules(model: Llava | QwenVL) -> list[nn.Module]:
    """The tower's modules the model never runs: LLaVA's blocks past the deepest feature layer and
    final LayerNorm (Qwen runs its whole tower). They can get no gradient, so they hold no optimizer
    state either (their weights travel unchanged to the export, which keeps them)."""
    if isinstance(model, QwenVL):
        return []
    tower = model.vision_tower
    deepest = max(model.cfg.feature_layers)
    return [block for key, block in tower.layers.items() if int(key) >= deepest] + [tower.post_norm]


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
    if batch.image_grid_thw is None or not isinstance(model, QwenVL):
        return None
    ids = batch.inputs[dp_rows(batch.inputs.shape[0], dims)]
    positions = model.rope_positions(ids, torch.cat(rank_image_grids(batch, dims)))  # [3, B, S]
    return sequence_chunk(positions.transpose(0, 1), dims, dim=2).contiguous()


def vision_language_entry(cfg: RunConfig) -> dict:
    """meta.json's `vision_language` entry of a checkpoint of this run: the model's config.json (its
    model_type says the family), the image processor and the tokenizer an export writes
    (data.tokenizer, the bundled one when unset)."""
    model_cfg, processor = vision_model_config(cfg)
    hf = qwen_vl_config_to_hf(model_cfg) if isinstance(model_cfg, QwenVLConfig) else llava_config_to_hf(model_cfg)
    return {"config": hf, "processor": processor.to_dict(), "tokenizer": cfg.data.tokenizer or "default"}
