"""Weights from a HuggingFace directory (config.json + safetensors, single or sharded), by one path.

    model = load_pretrained("path/to/Mixtral-8x7B", dtype=torch.bfloat16)   # one process, whole tensors

`load_hf_shards` is the one filler: it reads from the files only each tensor's local box
(`slices.local_box`: a rank's expert, tensor- and data-parallel shards plus the replicated tensors,
never the whole model) into model parts (checkpoint/parts.py), after checking the directory against
the whole model's names and shapes. `build_from_hf` builds a model on the meta device, lets the
caller cut it (tensor-parallel serving's shard), gives it storage in its dtype and fills it that
way; `load_pretrained` is `build_from_hf` for one whole model after checking the directory, with
errors that name what is wrong: an unsupported architecture lists the supported ones, missing or
unexpected tensors list the first few keys, a shape mismatch names the key and both shapes. A
training run (`train.init_from`) calls `load_hf_shards` on the parts its layout built.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from tessera.checkpoint.hf.names import hf_copies, unread
from tessera.checkpoint.hf.slices import HFSliceReader, local_box
from tessera.checkpoint.hf.writer import first_keys
from tessera.checkpoint.parts import allocate
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import read_hf_config, read_json_object
from tessera.config.model import ModelConfig
from tessera.config.vision_families import family_of_config
from tessera.models.lazy_torch import local_tensor, on_meta, to_empty
from tessera.models.transformer import Transformer


def check_hf_fits(reader: HFSliceReader, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse (CheckpointError naming the key and both shapes) a HuggingFace directory that lacks a
    tensor of the model, stores one with another shape, or holds weights the model has no place
    for. `shapes` are the whole model's tensors (every stage's), as built from its config."""
    needed = set()
    for key, shape in shapes.items():
        if key not in reader.names:
            if key.endswith("expert_bias"):
                continue  # a family without a stored bias: it starts at zero
            raise CheckpointError(f"{source} does not fit the model: no HuggingFace tensor maps to {key!r}")
        missing = [h for h in reader.names[key] if h not in reader.files.files]
        if missing:
            raise CheckpointError(f"{source} does not fit the model: it has no {key!r} (HuggingFace tensor "
                                  f"{missing[0]!r} is missing)")
        needed.update(reader.names[key])
        stored = reader.shape(key)
        if tuple(stored) != tuple(shape):
            raise CheckpointError(f"{source} does not fit the model: {key!r} has shape {list(stored)} there but "
                                  f"{list(shape)} in the model")
    needed.update(hf_copies(reader.cfg))  # copies of tensors the model holds once: not read
    extra = sorted(k for k in reader.files.files if k not in needed and k not in reader.foreign
                   and not unread(reader.cfg, k)
                   and not (k == "lm_head.weight" and "output.weight" not in shapes))
    if extra:
        raise CheckpointError(f"{source} does not fit the model: it has {extra[0]!r}, which the model has no "
                              f"place for ({len(extra)} such tensors; is the model config the HuggingFace one?)")


@torch.no_grad()
def load_hf_shards(parts: Iterable[nn.Module], path: str | os.PathLike, cfg: ModelConfig,
                   device: torch.device | str, shapes: dict[str, tuple[int, ...]] | None = None,
                   source: str | None = None) -> int:
    """Fill every parameter and buffer of `parts` (Transformers or stages of one, parallelized or
    not; allocated on `device` first if they are on the meta device) from HuggingFace directory
    `path`, reading only each tensor's local box. `shapes` (default: the parts' own) are the whole
    model's, checked against the files first. Returns the bytes read from the files."""
    parts = list(parts)
    device = torch.device(device)
    reader = HFSliceReader(path, cfg)
    if shapes is None:
        shapes = {k: tuple(v.shape) for m in parts for k, v in m.state_dict().items()}
    check_hf_fits(reader, shapes, source or f"HuggingFace directory {str(path)!r}")
    allocate(parts, device)
    for module in parts:
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        for name, t in tensors:
            if name in reader.names:
                offsets, sizes = local_box(t)
                local = local_tensor(t)
                local.copy_(reader.read(name, offsets, sizes).to(local.dtype))
            elif name.endswith("expert_bias"):
                t.zero_()
        module.reset_rope(device)
    return reader.bytes_read


def build_from_hf(path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                  cut: Callable[[Transformer], Transformer] | None = None) -> Transformer:
    """The model `cfg` with the weights of HuggingFace directory `path`, in eval mode: built on the
    meta device, cut by `cut` (None: whole), given storage on `device` in `dtype` (but for the
    routing bias, which stays fp32: `Transformer.cast`), then filled by `load_hf_shards`."""
    with on_meta():
        model = Transformer(cfg, init_seed=None)
    if cut is not None:
        model = cut(model)
    to_empty(model, device)
    model.cast(dtype)
    load_hf_shards([model], path, cfg, device, source=f"HuggingFace directory {str(path)!r}")
    return model.eval()


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    """A Tessera `Transformer` with the weights of a HuggingFace model directory (`build_from_hf`),
    after the directory is checked against the model its config.json describes (names and shapes,
    from the files' headers)."""
    cfg, _ = checked_directory(path)
    return build_from_hf(path, cfg, dtype, device)


def checked_directory(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """The config of HuggingFace model directory `path` and its model's tensor shapes, after the
    directory is checked against them (CheckpointError naming what is missing, extra or misshapen)."""
    path = Path(path)
    _refuse_vision_language(path)
    cfg = read_hf_config(path)
    reader = HFSliceReader(path, cfg)
    available = {k for k in reader.files.keys() if not unread(cfg, k)}
    needed = {h for hs in reader.names.values() for h in hs}
    if cfg.tie_embeddings:
        available.discard("lm_head.weight")
    missing, unexpected = needed - available, available - needed - set(hf_copies(cfg))
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing for {cfg.family}: {first_keys(missing)}")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) for {cfg.family}: "
                              f"{first_keys(unexpected)}")
    with on_meta():
        shapes = {k: tuple(t.shape) for k, t in Transformer(cfg, init_seed=None).state_dict().items()}
    for key, shape in shapes.items():
        if key in reader.names and reader.shape(key) != shape:
            raise CheckpointError(f"{path}: shape mismatch for {reader.names[key][0]} (-> {key}): checkpoint "
                                  f"{reader.shape(key)}, model config expects {shape}")
    return cfg, shapes


def _refuse_vision_language(path: Path) -> None:
    """ConfigError when `path` is a vision-language family's directory (its config.json's model_type),
    naming the family and what loads it."""
    f = path / "config.json"
    try:
        family = family_of_config(read_json_object(f)) if f.is_file() else None
    except CheckpointError:  # read_hf_config, next, says what is wrong with the file
        return
    if family is not None:
        raise ConfigError(f"{str(path)!r} is a {family.title} (vision-language) directory, not a language model's: "
                          f"load it with {family.loader}, serve it with `tessera serve` or `LLM`, or train its "
                          "language model with train.init_from")
