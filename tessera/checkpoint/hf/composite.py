"""The steps a vision-language HuggingFace directory (hf/llava.py, hf/qwen_vl.py) shares: telling
it by its config.json, loading its tensors into the model after checking them against the names the
config implies, reading its image processor, and writing the model back with its image processor's
config. A family's directory is a `DirectoryFormat` of its parts, whose `load`, `read_processor`
and `save` are these steps.

Names are given as Tessera key -> HuggingFace key(s) in the in-memory layout (more than one for
routed experts, stacked into one Tessera tensor), with the family's rename from a stored name to
that layout (`current`) and back (`saved`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.hf.files import SafetensorsDir
from tessera.checkpoint.hf.names import IGNORED_SUFFIXES
from tessera.checkpoint.hf.writer import first_keys, write_hf_files
from tessera.config.errors import CheckpointError
from tessera.config.hf_config import read_json_object
from tessera.data.image_processor import PROCESSOR_FILE


def config_says(path: str | os.PathLike, predicate: Callable[[Mapping[str, Any]], bool]) -> bool:
    """Whether `path` holds a readable config.json of which `predicate` holds."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return predicate(read_json_object(f))
    except CheckpointError:
        return False


def read_directory_config(path: str | os.PathLike, read_file: Callable[[Mapping[str, Any], str], Any]) -> Any:
    """`read_file` of `path`'s config.json object and the file's name."""
    f = Path(path) / "config.json"
    return read_file(read_json_object(f), str(f))


def _exports_as_is(cfg: Any) -> None:
    """A family whose export refuses nothing its config does not already refuse."""


def _reads_every(cfg: Any, key: str) -> bool:
    """A family whose files hold nothing its model leaves unread."""
    return False


@dataclass(frozen=True)
class DirectoryFormat:
    """One vision-language family's HuggingFace directory (hf/llava.py, hf/qwen_vl.py): how its
    config.json is read (`read_file(d, source)`) and written (`to_hf(cfg)`), its model and image
    processor classes (`model(cfg, init_seed=None)`, `processor.for_vision(cfg.vision)`), its
    tensors' names (`names(cfg)` in the in-memory layout, `current` / `saved` the renames from a
    stored name and back), its language model's names alone (`language_model_names`: a text model
    read from the directory, hf/slices.py), what its export refuses (`check(cfg)`) and the stored
    tensors its model leaves unread as transformers does (`unread(cfg, stored name)`: Qwen3.5's
    multi-token-prediction layers)."""

    read_file: Callable[[Mapping[str, Any], str], Any]
    to_hf: Callable[[Any], dict[str, Any]]
    model: Callable[..., nn.Module]
    processor: Any
    names: Callable[[Any], dict[str, list[str]]]
    current: Callable[[str], str]
    saved: Callable[[str], str]
    language_model_names: Callable[[dict[str, list[str]], set[str]], tuple[dict[str, list[str]], set[str]]]
    check: Callable[[Any], None] = _exports_as_is
    unread: Callable[[Any, str], bool] = _reads_every

    def load(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> Any:
        """The model of directory `path`, in eval mode, after its tensors are checked against the
        model its config.json describes (missing, unexpected, shapes)."""
        path = Path(path)
        cfg = read_directory_config(path, self.read_file)
        with torch.device("meta"):
            model = self.model(cfg, init_seed=None)
        return load_composite(path, model, self.names(cfg), self.current, cfg.family, dtype, device,
                              lambda key: self.unread(cfg, key))

    def read_processor(self, path: str | os.PathLike, cfg: Any) -> Any:
        """Directory `path`'s image processor (read from its preprocessor_config.json and checked to
        make what `cfg`'s tower takes), else the one the tower ships with."""
        f = Path(path) / PROCESSOR_FILE
        if not f.is_file():
            return self.processor.for_vision(cfg.vision)
        proc = self.processor.from_directory(path)
        proc.check_tower(cfg.vision, str(f))
        return proc

    def save(self, model: nn.Module, path: str | os.PathLike, tokenizer=None, processor: Any = None,
             max_shard_bytes: int = 5 * 2**30) -> None:
        """Write `model` as a directory: config.json, safetensors, preprocessor_config.json
        (`processor`, else the tower's own) and, with `tokenizer`, its files (hf/writer.py)."""
        self.check(model.cfg)
        proc = processor or self.processor.for_vision(model.cfg.vision)
        save_composite(model, path, self.names(model.cfg), self.saved, self.to_hf(model.cfg), proc.to_dict(),
                       tokenizer, max_shard_bytes)


def load_composite(path: Path, model: nn.Module, names: dict[str, list[str]], current: Callable[[str], str],
                   what: str, dtype: torch.dtype, device: str | torch.device,
                   unread: Callable[[str], bool] = lambda key: False) -> nn.Module:
    """`model` (built on the meta device from the directory's config) with the directory's tensors,
    in eval mode, after the stored names are checked against `names` (missing, unexpected, shapes);
    stored names `unread` says the model leaves unread are not read."""
    files = SafetensorsDir(path)
    stored = {current(k): k for k in files.keys() if not k.endswith(IGNORED_SUFFIXES) and not unread(k)}
    needed = {h for hs in names.values() for h in hs}
    if model.cfg.text.tie_embeddings:
        stored.pop("lm_head.weight", None)
    missing, unexpected = needed - set(stored), set(stored) - needed
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing for {what}: {first_keys(missing)}")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) for {what}: {first_keys(unexpected)}")
    model.to_empty(device=device)
    model.cast(dtype)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            keys = [stored[h] for h in names[name]]
            value = files.get(keys[0]) if len(keys) == 1 else torch.stack([files.get(k) for k in keys])
            if tuple(value.shape) != tuple(t.shape):
                raise CheckpointError(f"{path}: shape mismatch for {keys[0]} (-> {name}): checkpoint "
                                      f"{list(value.shape)}, model config expects {list(t.shape)}")
            t.copy_(value.to(t.dtype))
    model.reset_rope(device)  # after the cast: the frequencies stay fp32
    return model.eval()


def save_composite(model: nn.Module, path: str | os.PathLike, names: dict[str, list[str]],
                   saved: Callable[[str], str], hf_config: dict, processor: dict, tokenizer,
                   max_shard_bytes: int) -> None:
    """Write `model` as a directory: config.json `hf_config`, safetensors under `saved` names (routed
    experts one tensor each), preprocessor_config.json `processor` and, with `tokenizer`, its files."""
    state = model.state_dict()
    tensors = {}
    for key, hf_keys in names.items():
        t = state[key].detach().cpu()
        parts = [t] if len(hf_keys) == 1 else t.unbind(0)
        tensors.update({saved(h): part.contiguous() for h, part in zip(hf_keys, parts, strict=True)})
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    extra = {PROCESSOR_FILE: json.dumps(processor, indent=2) + "\n"}
    write_hf_files(path, hf_config, model.cfg.text.vocab_size, next(model.parameters()).dtype, sizes,
                   lambda keys: {k: tensors[k] for k in keys}, max_shard_bytes, tokenizer, extra)
