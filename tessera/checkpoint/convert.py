"""Models from checkpoints, and conversion between HuggingFace directories and Tessera checkpoints.

A Tessera checkpoint (`tessera.checkpoint.dcp`) keeps the run configuration in its meta.json, so
a model can be rebuilt from the checkpoint alone. A HuggingFace directory has a config.json and
safetensors (`tessera.checkpoint.hf`). `load_model` takes either, and `convert` writes one as
the other: HF -> a checkpoint root holding `step_00000000/` (model weights only), Tessera -> HF
(read one safetensors file's tensors at a time, never the whole model: `hf_export`).

`load_tessera_model` is the one loader of whole Tessera models: `tessera generate` and serving
(`tessera.infer`) use it; it and `train.init_from` read the weights with
`sharded_load.load_checkpoint_shards`. Reading and the export check the files against their
recorded checksums first and unpickle nothing beyond plain data.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.checkpoint import dcp as ckpt
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import is_hf_directory, read_hf_config
from tessera.config.model import ModelConfig
from tessera.config.schema import RunConfig, build_model_config, config_from_dict
from tessera.models import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stored_run_config(path: str | os.PathLike) -> dict:
    """The run configuration a Tessera checkpoint was saved with, as the plain dict in its meta.json."""
    meta = ckpt.read_meta(path)
    raw = meta.get("config")
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: its meta.json has no config.model section; cannot "
                              "rebuild the model")
    return raw


def checkpoint_run_config(path: str | os.PathLike) -> RunConfig:
    """The run configuration a Tessera checkpoint was saved with, validated."""
    try:
        return config_from_dict(stored_run_config(path))
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: the run configuration in its meta.json is invalid: "
                              f"{e}") from e


def stored_model_config(path: str | os.PathLike) -> ModelConfig:
    """The model shape a Tessera checkpoint was saved with."""
    try:
        return build_model_config(stored_run_config(path)["model"])
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: config.model in its meta.json is invalid: {e}") from e


def load_model_weights(path: str | os.PathLike, model: Transformer) -> None:
    """Copy the model weights of Tessera checkpoint `path` into `model` (keys and shapes must match),
    after checking its files against their checksums: `sharded_load.load_checkpoint_shards`, what
    `train.init_from` uses, for one whole model."""
    from tessera.checkpoint.sharded_load import load_checkpoint_shards

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


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"
               ) -> tuple[Transformer, RunConfig | None]:
    """A model from a HuggingFace directory (run config None) or a Tessera checkpoint, in fp32."""
    if is_hf_directory(path):
        from tessera.checkpoint.hf import load_pretrained

        return load_pretrained(path, dtype=torch.float32, device=device), None
    model, _ = load_tessera_model(path, device=device)
    return model, checkpoint_run_config(ckpt.resolve_checkpoint(path))


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


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "fp32",
            tokenizer: str | os.PathLike | None = None, layout: list[str] | None = None) -> tuple[str, Path]:
    """HF directory -> Tessera checkpoint root, or Tessera checkpoint -> HF directory.

    Tessera -> HF reads a checkpoint saved under any parallel layout one shard file at a time
    (hf_export.py) and writes the tokenizer with the weights: `tokenizer` when given, else the
    run's `data.tokenizer` (the bundled one when that is unset). HF -> Tessera records the tokenizer
    (`tokenizer`, else the HF directory's own when it has one) as the checkpoint's data.tokenizer.
    Returns ("tessera" | "huggingface", what was written). `dst` must not be `src`.
    `layout` (`parallel.K=V` overrides, HF -> Tessera only) cuts the checkpoint's chunks into the
    shards of that layout without loading the whole model (layout_checkpoint.py).
    """
    if Path(src).resolve() == Path(dst).resolve():
        raise CheckpointError(f"convert: destination {str(dst)!r} is the source; choose another directory")
    if dtype not in DTYPES:
        raise CheckpointError(f"convert: dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if Path(dst).exists() and not Path(dst).is_dir():
        raise CheckpointError(f"convert: destination {str(dst)!r} is a file; give a new directory")
    if Path(dst).exists() and any(Path(dst).iterdir()):
        raise CheckpointError(f"convert: destination {str(dst)!r} is not empty; choose a new directory "
                              "(converting into a run's checkpoints would take over its `latest`)")
    if not os.access(_nearest_existing(Path(dst)), os.W_OK):
        raise CheckpointError(f"convert: destination {str(dst)!r} cannot be written (read-only or no "
                              "permission); choose a writable directory")
    if is_hf_directory(src):
        own = Path(src) / "tokenizer.json"
        source = tokenizer or (str(Path(src).resolve()) if own.is_file() else None)
        recorded = None if source is None else str(source)
        if layout:
            from tessera.checkpoint.layout_checkpoint import save_layout_checkpoint

            return "tessera", save_layout_checkpoint(src, dst, layout, DTYPES[dtype], recorded)
        from tessera.checkpoint.hf import load_pretrained

        model = load_pretrained(src, dtype=DTYPES[dtype])
        return "tessera", save_model_checkpoint(model, dst, tokenizer=recorded)
    if layout:
        raise ConfigError("convert --set parallel.* applies to HuggingFace -> Tessera only: a HuggingFace "
                          "export has no layout")
    from tessera.checkpoint.hf_export import export_checkpoint_to_hf

    found = ckpt.resolve_checkpoint(src)  # saved under any layout; read one shard file at a time
    source = tokenizer or checkpoint_run_config(found).data.tokenizer or "default"
    export_checkpoint_to_hf(found, dst, dtype=DTYPES[dtype], tokenizer=source)
    return "huggingface", Path(dst)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (where a new directory would be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def model_config_of(path: str | os.PathLike) -> ModelConfig:
    """The model shape stored in a HuggingFace directory or a Tessera checkpoint, without weights."""
    if is_hf_directory(path):
        return read_hf_config(path)
    return stored_model_config(ckpt.resolve_checkpoint(path))
