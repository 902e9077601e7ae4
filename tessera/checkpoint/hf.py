"""Load and save HuggingFace model directories (config.json + safetensors, single or sharded).

    model = load_pretrained("path/to/Mixtral-8x7B", dtype=torch.bfloat16)
    save_pretrained(model, "out/", tokenizer="path/to/Mixtral-8x7B")   # AutoModelForCausalLM and
                                                                        # AutoTokenizer load "out/"

One process, whole tensors. Errors name what is wrong: an unsupported architecture lists the
supported ones, missing or unexpected tensors list the first few keys, a shape mismatch names the
key and both shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.checkpoint.hf_slices import HFSliceReader
from tessera.checkpoint.hf_weights import IGNORED_SUFFIXES, hf_names
from tessera.checkpoint.hf_writer import first_keys, write_hf_directory
from tessera.config.errors import CheckpointError
from tessera.config.hf_config import read_hf_config
from tessera.models.transformer import Transformer


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    """A Tessera `Transformer` with the weights of a HuggingFace model directory, filled by the same
    reader as `train.init_from` (`sharded_load.load_hf_shards`) after the directory is checked
    against the model its config.json describes (names and shapes, from the files' headers)."""
    from tessera.checkpoint.sharded_load import load_hf_shards

    path = Path(path)
    cfg = read_hf_config(path)
    reader = HFSliceReader(path, cfg)
    available = {k for k in reader.files.keys() if not k.endswith(IGNORED_SUFFIXES)}
    needed = {h for hs in reader.names.values() for h in hs}
    if cfg.tie_embeddings:
        available.discard("lm_head.weight")
    missing, unexpected = needed - available, available - needed
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing for {cfg.family}: {first_keys(missing)}")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) for {cfg.family}: "
                              f"{first_keys(unexpected)}")
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    for key, t in model.state_dict().items():
        if key in reader.names and reader.shape(key) != tuple(t.shape):
            raise CheckpointError(f"{path}: shape mismatch for {reader.names[key][0]} (-> {key}): checkpoint "
                                  f"{reader.shape(key)}, model config expects {tuple(t.shape)}")
    model.to_empty(device=device)
    model.cast(dtype)  # the routing bias stays fp32
    load_hf_shards([model], path, cfg, device, source=f"HuggingFace directory {str(path)!r}")
    return model.eval()


def _hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under their HuggingFace names, in model order (routed experts split)."""
    state, out = model.state_dict(), {}
    for key, hf_keys in hf_names(model.cfg).items():
        t = state[key].detach().cpu()
        parts = [t] if len(hf_keys) == 1 else t.unbind(0)
        out.update({h: part.contiguous() for h, part in zip(hf_keys, parts, strict=True)})
    return out


def save_pretrained(model: Transformer, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                    tokenizer=None) -> None:
    """Write config.json and safetensors (sharded above `max_shard_bytes`, with an index) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads, and with `tokenizer` (a
    `tessera.data.Tokenizer`, a tokenizer directory or file, or "default" for the bundled one) its
    files, special-token ids and chat template (hf_tokenizer.py), so that `AutoTokenizer` and
    `tessera serve` read the directory alone. Written to a temporary directory beside `path` and
    renamed into place, so a failed save leaves any earlier `path` intact; the directory and its
    files get the permissions the process's umask gives ordinary files (hf_writer.py, which
    `tessera.checkpoint.hf_export` shares to write a checkpoint's weights without loading them all)."""
    state = _hf_state(model)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    write_hf_directory(path, model.cfg, next(model.parameters()).dtype, sizes,
                       lambda keys: {k: state[k] for k in keys}, max_shard_bytes, tokenizer)
