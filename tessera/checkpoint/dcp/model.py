"""A model saved as, and rebuilt from, a Tessera checkpoint alone.

A Tessera checkpoint keeps the run configuration in its meta.json, so the model is rebuilt from
the checkpoint alone: its `model` section gives the shape (`stored_model_config`), the DCP files
the weights (`load_checkpoint_shards`, what `train.init_from` uses, for one whole model).
`save_model_checkpoint` writes a model's weights as a checkpoint without optimizer state, with a
run configuration that validates.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.model import ModelConfig
from tessera.config.schema import RunConfig, build_model_config
from tessera.models import Transformer


def stored_run_config(path: str | os.PathLike) -> dict:
    """The run configuration a Tessera checkpoint was saved with, as the plain dict in its meta.json."""
    meta = ckpt.read_meta(path)
    raw = meta.get("config")
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: its meta.json has no config.model section; cannot "
                              "rebuild the model")
    return raw


def stored_model_config(path: str | os.PathLike) -> ModelConfig:
    """The model shape a Tessera checkpoint was saved with."""
    try:
        return build_model_config(stored_run_config(path)["model"])
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: config.model in its meta.json is invalid: {e}") from e


def load_model_weights(path: str | os.PathLike, model: Transformer) -> None:
    """Copy the model weights of Tessera checkpoint `path` into `model` (keys and shapes must match),
    after checking its files against their checksums."""
    from tessera.checkpoint.dcp.shards import load_checkpoint_shards  # torch's DCP: only when a checkpoint loads

    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    load_checkpoint_shards([model], path, shapes, next(model.parameters()).device)


def load_tessera_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> tuple[Transformer, dict]:
    """The model of a run directory / checkpoint root / checkpoint (in eval mode, in `dtype`, but
    for the fp32 routing bias: `Transformer.cast`) and the run configuration stored with it (the
    plain dict of its meta.json)."""
    found = ckpt.resolve_checkpoint(path)
    model = Transformer(stored_model_config(found), init_seed=None)
    load_model_weights(found, model)
    return model.cast(dtype, device).eval(), stored_run_config(found)


def save_model_checkpoint(model: Transformer, root: str | os.PathLike, cfg: RunConfig | None = None,
                          step: int = 0, tokenizer: str | None = None) -> Path:
    """Write `model`'s weights as a Tessera checkpoint `root/step_N` (no optimizer state);
    without `cfg`, `tokenizer` is recorded as its data.tokenizer (what generate and serve use)."""
    if cfg is None:  # a run config that validates: defaults, with a sequence length the model takes
        cfg = RunConfig(model=model.cfg, run_dir=str(root))
        cfg.train.seq_len = min(cfg.train.seq_len, model.cfg.max_seq_len)
        cfg.data.tokenizer = tokenizer
    state = {"model": {k: v.detach() for k, v in model.state_dict().items()}}
    return ckpt.save_checkpoint(root, step, state, {"config": cfg.to_dict()}, keep_last=1)
