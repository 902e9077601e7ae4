"""A vision-language model (LLaVA, Qwen2-VL, Qwen2.5-VL) as a Tessera checkpoint, and back.

The checkpoint is an ordinary one (dcp/store.py): the model's tensors under the model's own names
(`Llava`, `QwenVL`), a run configuration whose `model` section is the language model's, and, in
meta.json's `vision_language` entry, the model's HuggingFace config.json (`llava_config_to_hf`,
`qwen_vl_config_to_hf`; its model_type says which) and its image processor's config, so the whole
model and its preprocessing are rebuilt from the checkpoint alone. This is what `tessera convert`
writes from a LLaVA / Qwen2-VL directory and reads to write one again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.shards import load_checkpoint_shards
from tessera.config.errors import CheckpointError, TesseraError
from tessera.config.qwen_vl import is_qwen_vl_config, qwen_vl_config_from_hf, qwen_vl_config_to_hf
from tessera.config.schema import RunConfig
from tessera.config.vision import llava_config_from_hf, llava_config_to_hf
from tessera.data.image_processor import ImageProcessor
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.models.llava import Llava
from tessera.models.qwen_vl import QwenVL

VisionLanguageModel = Llava | QwenVL

ENTRY = "vision_language"  # meta.json key


def is_vision_language_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` resolves to a Tessera checkpoint holding a vision-language model."""
    try:
        return isinstance(ckpt.read_meta(ckpt.resolve_checkpoint(path)).get(ENTRY), dict)
    except CheckpointError:
        return False


def save_vision_language_checkpoint(model: VisionLanguageModel, root: str | os.PathLike,
                          processor: ImageProcessor | QwenImageProcessor, tokenizer: str | None = None) -> Path:
    """Write `model` (weights only) as checkpoint `root/step_00000000`; `tokenizer` is recorded as
    its run's data.tokenizer."""
    cfg = RunConfig(model=model.cfg.text, run_dir=str(root))
    cfg.train.seq_len = min(cfg.train.seq_len, model.cfg.text.max_seq_len)
    cfg.data.tokenizer = tokenizer
    state = {"model": {k: v.detach() for k, v in model.state_dict().items()}}
    hf_config = qwen_vl_config_to_hf(model.cfg) if isinstance(model, QwenVL) else llava_config_to_hf(model.cfg)
    entry = {"config": hf_config, "processor": processor.to_dict()}
    return ckpt.save_checkpoint(root, 0, state, {"config": cfg.to_dict(), ENTRY: entry}, keep_last=1)


def load_vision_language_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu",
                          ) -> tuple[VisionLanguageModel, ImageProcessor | QwenImageProcessor, dict]:
    """The model, image processor and stored run configuration of a vision-language checkpoint."""
    found = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(found)
    entry = meta.get(ENTRY)
    try:
        qwen = is_qwen_vl_config(entry["config"])
        cfg = (qwen_vl_config_from_hf if qwen else llava_config_from_hf)(entry["config"])
        processor = (QwenImageProcessor if qwen else ImageProcessor).from_dict(entry["processor"], f"{found}/meta.json")
    except (TesseraError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(found)!r}: its {ENTRY!r} entry in meta.json is invalid ({e})") from e
    model = QwenVL(cfg, init_seed=None) if qwen else Llava(cfg, init_seed=None)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    load_checkpoint_shards([model], found, shapes, torch.device("cpu"))
    model.cast(dtype, device)
    model.reset_rope(device)  # after the cast: the frequencies stay fp32
    return model.eval(), processor, meta["config"]
