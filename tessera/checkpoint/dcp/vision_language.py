"""A vision-language model (LLaVA, Qwen2-VL, Qwen2.5-VL) as a Tessera checkpoint, and back.

The checkpoint is an ordinary one (dcp/store.py): the model's tensors under the model's own names
(`Llava`, `QwenVL`), a run configuration whose `model` section is the language model's, and, in
meta.json's `vision_language` entry, the model's HuggingFace config.json (its model_type names the
family: tessera/config/vision_families.py) and its image processor's config, so the whole model and
its preprocessing are rebuilt from the checkpoint alone (the family's parts:
tessera/checkpoint/vision_families.py). This is what `tessera convert`
writes from a LLaVA / Qwen2-VL directory and reads to write one again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.vision_families import REGISTRY
from tessera.config.errors import CheckpointError, TesseraError
from tessera.config.schema import RunConfig
from tessera.config.vision_families import vision_language_config_from_hf, vision_language_config_to_hf
from tessera.models.vision.vision_language import VisionLanguageModel

ENTRY = "vision_language"  # meta.json key


def is_vision_language_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` resolves to a Tessera checkpoint holding a vision-language model."""
    try:
        return isinstance(ckpt.read_meta(ckpt.resolve_checkpoint(path)).get(ENTRY), dict)
    except CheckpointError:
        return False


def save_vision_language_checkpoint(model: VisionLanguageModel, root: str | os.PathLike, processor: Any,
                                    tokenizer: str | None = None) -> Path:
    """Write `model` (weights only) as checkpoint `root/step_00000000`; `tokenizer` is recorded as
    its run's data.tokenizer."""
    cfg = RunConfig(model=model.cfg.text, run_dir=str(root))
    cfg.train.seq_len = min(cfg.train.seq_len, model.cfg.text.max_seq_len)
    cfg.data.tokenizer = tokenizer
    state = {"model": {k: v.detach() for k, v in model.state_dict().items()}}
    entry = {"config": vision_language_config_to_hf(model.cfg), "processor": processor.to_dict()}
    return ckpt.save_checkpoint(root, 0, state, {"config": cfg.to_dict(), ENTRY: entry}, keep_last=1)


def read_vision_language_entry(found: Path) -> tuple[Any, Any]:
    """The model config and image processor that checkpoint `found`'s meta.json entry holds."""
    entry = ckpt.read_meta(found).get(ENTRY)
    try:
        cfg = vision_language_config_from_hf(entry["config"])
        processor = REGISTRY[cfg.family].directory.processor.from_dict(entry["processor"], f"{found}/meta.json")
    except (TesseraError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(found)!r}: its {ENTRY!r} entry in meta.json is invalid ({e})") from e
    return cfg, processor


def load_vision_language_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                                    device: str | torch.device = "cpu") -> tuple[VisionLanguageModel, Any, dict]:
    """The model, image processor and stored run configuration of a vision-language checkpoint."""
    from tessera.checkpoint.dcp.shards import load_checkpoint_shards  # torch's DCP: only when a checkpoint loads

    found = ckpt.resolve_checkpoint(path)
    cfg, processor = read_vision_language_entry(found)
    model = REGISTRY[cfg.family].directory.model(cfg, init_seed=None)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    load_checkpoint_shards([model], found, shapes, torch.device("cpu"))
    model.cast(dtype, device)
    model.reset_rope(device)  # after the cast: the frequencies stay fp32
    return model.eval(), processor, ckpt.read_meta(found)["config"]
