"""The model side of a vision-language fine-tune (`data.kind=vision_sft`, tessera.config.vision_training).

    llava_cfg, processor = vision_model_config(cfg)     # from train.init_from's LLaVA, else the config
    model = build_vision_model(cfg, device, init_from)  # a Llava, its frozen parts frozen

The model is built whole on every rank (no meta-device build: each rank holds the whole model
until the layout cuts it), then cut by the layout (tessera.train.builder): every layout of the
language model (dp_replicate, dp_shard, tp with or without sp, cp, ep, pp), the tower and
projector beside it and on the first pipeline stage only (tessera.parallel.vision_language). The
step engines need nothing of their own for it beyond each rank's images (`rank_images`): a batch's
`pixel_values` reach `Llava.forward(input_ids, pixel_values=..., targets=...)`
(step_engine.accumulate_micro_batches; under pp the first stage's, one micro-batch's rows at a
time: pipeline_step.PipelineStep), which encodes the images and puts their features at the image
placeholders. A checkpoint's
meta.json holds the LLaVA config and image processor (`vision_language_entry`, the entry
tessera.checkpoint.dcp.vision_language reads), so `tessera convert` and `checkpoint.export_hf`
write a LLaVA directory from it.
"""

from __future__ import annotations

import torch

from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import model_differences
from tessera.config.schema import RunConfig
from tessera.config.vision import LlavaConfig, llava_config_from_hf, llava_config_to_hf
from tessera.config.vision_training import DATA_KIND
from tessera.data.batching import Batch
from tessera.data.image_processor import ImageProcessor
from tessera.models.llava import Llava
from tessera.parallel.data_parallel_batch import dp_rows
from tessera.parallel.dims import ParallelDims

FROZEN_PARTS = {"freeze_vision_tower": "vision_tower", "freeze_projector": "projector",
                "freeze_language_model": "language_model"}


def is_vision_run(cfg: RunConfig) -> bool:
    return cfg.data.kind == DATA_KIND


def _source(cfg: RunConfig) -> str | None:
    """"hf" or "checkpoint" when train.init_from holds a whole LLaVA, else None."""
    from tessera.checkpoint.dcp.vision_language import is_vision_language_checkpoint
    from tessera.checkpoint.hf.llava import is_llava_directory

    path = cfg.train.init_from
    if path is None:
        return None
    if is_llava_directory(path):
        return "hf"
    if is_vision_language_checkpoint(path):
        return "checkpoint"
    raise ConfigError(f"train.init_from={path!r} is invalid with data.kind={DATA_KIND}: a LLaVA HuggingFace directory "
                      "or a Tessera vision-language checkpoint (tessera convert LLAVA_DIR OUT writes one); null: "
                      "the tower and projector of train.vision_language, built from train.seed")


def vision_model_config(cfg: RunConfig) -> tuple[LlavaConfig, ImageProcessor]:
    """The LLaVA to train and its image processor: train.init_from's, else train.vision_language's
    tower and projector over the `model` section's language model."""
    source = _source(cfg)
    if source == "hf":
        from tessera.checkpoint.hf.llava import read_llava_config, read_processor

        llava = read_llava_config(cfg.train.init_from)
        processor = read_processor(cfg.train.init_from, llava)
    elif source == "checkpoint":
        from tessera.checkpoint.dcp import store as ckpt
        from tessera.checkpoint.dcp.vision_language import ENTRY

        found = ckpt.resolve_checkpoint(cfg.train.init_from)
        entry = ckpt.read_meta(found)[ENTRY]
        llava = llava_config_from_hf(entry["config"])
        processor = ImageProcessor.from_dict(entry["processor"], f"{found}/meta.json")
    else:
        v = cfg.train.vision_language
        token = v.image_token_id if v.image_token_id is not None else cfg.model.vocab_size - 1
        layers = v.feature_layer[0] if len(v.feature_layer) == 1 else list(v.feature_layer)
        try:
            llava = LlavaConfig(text=cfg.model, vision=v.tower, image_token_id=token, feature_layer=layers,
                                select_strategy=v.select_strategy, projector_act=v.projector_act)
        except ConfigError as e:
            raise ConfigError(f"train.vision_language: {e}") from e
        return llava, ImageProcessor.for_vision(v.tower)
    differences = model_differences(cfg.model, llava.text, shapes_only=True)
    if differences:
        raise ConfigError(f"the model section differs from train.init_from={cfg.train.init_from!r}'s language model in "
                          f"{', '.join(differences[:4])}: leave the model section empty to take the source's")
    return llava, processor


def build_vision_model(cfg: RunConfig, device: torch.device, init_from: str | None) -> Llava:
    """The LLaVA of `cfg` on `device` in train mode: read from `init_from` (the start of a run; None
    when resuming, where the checkpoint fills it) or initialised from train.seed; then the parts
    the freeze switches name stop requiring gradients (so the optimizer holds no state for them)."""
    llava_cfg, _ = vision_model_config(cfg)
    if init_from is None:
        model = Llava(llava_cfg, init_seed=cfg.train.seed).to(device)
    elif _source(cfg) == "hf":
        from tessera.checkpoint.hf.llava import load_llava

        model = load_llava(init_from, torch.float32, device)
    else:
        from tessera.checkpoint.dcp.vision_language import load_vision_language_checkpoint

        model, _, _ = load_vision_language_checkpoint(init_from, torch.float32, device)
    if model.cfg != llava_cfg:
        raise CheckpointError(f"train.init_from={init_from!r} holds another model than its config describes")
    for switch, part in FROZEN_PARTS.items():
        if getattr(cfg.train.vision_language, switch):
            getattr(model, part).requires_grad_(False)
    for module in unused_tower_modules(model):
        module.requires_grad_(False)
    return model.train()


def unused_tower_modules(model: Llava) -> list[torch.nn.Module]:
    """The tower's modules LLaVA never runs: the blocks past the deepest feature layer and the final
    LayerNorm. They can get no gradient, so they hold no optimizer state either (their weights travel
    unchanged to the export, which keeps them)."""
    tower = model.vision_tower
    deepest = max(model.cfg.feature_layers)
    return [block for key, block in tower.layers.items() if int(key) >= deepest] + [tower.post_norm]


def rank_images(batch: Batch, dims: ParallelDims | None) -> list[torch.Tensor] | None:
    """This rank's rows' images of a vision-language batch (None for text), as `shard_global_batch`
    takes its rows."""
    if batch.pixel_values is None or dims is None:
        return batch.pixel_values
    return batch.pixel_values[dp_rows(len(batch.pixel_values), dims)]


def vision_language_entry(cfg: RunConfig) -> dict:
    """meta.json's `vision_language` entry of a checkpoint of this run: LLaVA's config.json, the image
    processor and the tokenizer an export writes (data.tokenizer, the bundled one when unset)."""
    llava_cfg, processor = vision_model_config(cfg)
    return {"config": llava_config_to_hf(llava_cfg), "processor": processor.to_dict(),
            "tokenizer": cfg.data.tokenizer or "default"}
