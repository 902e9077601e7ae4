"""Load and save HuggingFace model directories (config.json + safetensors, single or sharded).

    model = load_pretrained("path/to/Mixtral-8x7B", dtype=torch.bfloat16)
    save_pretrained(model, "out/", tokenizer="path/to/Mixtral-8x7B")   # AutoModelForCausalLM and
                                                                        # AutoTokenizer load "out/"

One process, whole tensors. Errors name what is wrong: an unsupported architecture lists the
supported ones, missing or unexpected tensors list the first few keys, a shape mismatch names the
key and both shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.checkpoint.hf_config import config_from_hf, config_to_hf
from tessera.checkpoint.hf_files import INDEX, SafetensorsDir, check_config_fields, read_json_object
from tessera.checkpoint.hf_tokenizer import (
    TOKENIZER_FILES,
    check_vocabulary,
    resolve_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)
from tessera.checkpoint.hf_weights import check_exportable, hf_names
from tessera.config.errors import CheckpointError, ConfigError, ModelError
from tessera.config.model import ModelConfig
from tessera.models.transformer import Transformer

_INDEX = INDEX
# HuggingFace-side keys that carry no weights Tessera needs (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _first(keys: list[str] | set[str], n: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (and {len(keys) - n} more)" if len(keys) > n else "")


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (not a HuggingFace model directory)")
    d = read_json_object(cfg_file)
    check_config_fields(d, cfg_file)
    try:
        return config_from_hf(d)
    except ModelError:  # an architecture Tessera does not reproduce: already names the field
        raise
    except ConfigError as e:  # values that do not fit together: a bad file, not a bad command line
        raise CheckpointError(f"{str(cfg_file)!r}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{str(cfg_file)!r}: required field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{str(cfg_file)!r}: a field has the wrong type ({e})") from e


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    """A Tessera `Transformer` with the weights of a HuggingFace model directory."""
    path = Path(path)
    cfg = read_hf_config(path)
    names = hf_names(cfg)
    reader = SafetensorsDir(path)
    available = {k for k in reader.keys() if not k.endswith(_IGNORED_SUFFIXES)}
    needed = {h for hs in names.values() for h in hs}
    if cfg.tie_embeddings:
        available.discard("lm_head.weight")
    missing, unexpected = needed - available, available - needed
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing for {cfg.family}: {_first(missing)}")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) for {cfg.family}: {_first(unexpected)}")
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    expected = {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    state = {}
    for key, hf_keys in names.items():
        parts = [reader.get(h) for h in hf_keys]
        stacked = expected[key].dim() == parts[0].dim() + 1  # routed experts: E tensors -> one [E, ...]
        t = torch.stack(parts) if stacked else parts[0]
        if tuple(t.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{path}: shape mismatch for {hf_keys[0]} (-> {key}): checkpoint "
                                  f"{tuple(t.shape)}, model config expects {tuple(expected[key].shape)}")
        keep_fp32 = key.endswith("expert_bias")
        state[key] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_rope(device)
    return model.eval()


def _hf_state(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    state = model.state_dict()
    for key, hf_keys in hf_names(model.cfg).items():
        t = state[key].detach().cpu()
        if len(hf_keys) == 1:
            yield hf_keys[0], t.contiguous()
        else:
            for h, part in zip(hf_keys, t.unbind(0), strict=True):
                yield h, part.contiguous()


def save_pretrained(model: Transformer, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                    tokenizer=None) -> None:
    """Write config.json and safetensors (sharded above `max_shard_bytes`, with an index) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads, and with `tokenizer` (a
    `tessera.data.Tokenizer`, a tokenizer directory or file, or "default" for the bundled one) its
    files, special-token ids and chat template (hf_tokenizer.py), so that `AutoTokenizer` and
    `tessera serve` read the directory alone. Written to a temporary directory beside `path` and
    renamed into place, so a failed save leaves any earlier `path` intact; the directory and its
    files get the permissions the process's umask gives ordinary files."""
    path = Path(path)
    cfg = model.cfg
    check_exportable(cfg)
    tok = resolve_tokenizer(tokenizer)
    if tok is not None:
        check_vocabulary(tok, cfg.vocab_size)
    hf_cfg = config_to_hf(cfg) | special_token_ids(tok)
    dtype = next(model.parameters()).dtype
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in _hf_state(model):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if path.exists():
        foreign = sorted(p.name for p in path.iterdir() if not _is_export_file(p.name))
        if foreign:
            raise CheckpointError(f"{path} holds files a HuggingFace export would not write ({_first(foreign)}); "
                                  "save into a new or empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_export(tmp, shards, hf_cfg)
        write_tokenizer_files(tmp, tok)
        _make_readable(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():  # only earlier export files are here: swap the whole directory
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
        os.replace(path, old / "dir")
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def _make_readable(directory: Path) -> None:
    """`mkdtemp` makes a private (0700) directory; give it and its files what the umask allows."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~mask)


def _is_export_file(name: str) -> bool:
    return name in ("config.json", "generation_config.json", _INDEX, *TOKENIZER_FILES) or (
        name.startswith("model") and name.endswith(".safetensors"))


def _write_export(tmp: Path, shards: list[dict[str, torch.Tensor]], hf_cfg: dict) -> None:
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], tmp / "model.safetensors", metadata=meta)
    else:
        weight_map, total = {}, 0
        for n, shard in enumerate(shards, 1):
            fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / fname, metadata=meta)
            weight_map.update({k: fname for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        (tmp / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
