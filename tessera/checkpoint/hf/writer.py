"""Writing a HuggingFace model directory: config.json, safetensors shards (+ index), tokenizer files.

    save_pretrained(model, "out/", tokenizer="path/to/Mixtral-8x7B")   # AutoModelForCausalLM and
                                                                        # AutoTokenizer load "out/"

`write_hf_directory` is the one writer: `save_pretrained` hands it the tensors of a model in
memory, `export_checkpoint_to_hf` (export.py) reads them from a Tessera checkpoint one shard
file at a time. Both give it the size of every HuggingFace tensor up front, so the shard plan
(`plan_shards`: tensors in model order, a new file when the next one would pass
`max_shard_bytes`), the file names and the index are known before any tensor is read, and the
writer asks for the tensors of one file at a time and drops them once it is written.

The directory is written beside `path` under a temporary name and renamed into place, so a failed
write leaves any earlier `path` intact; a `path` holding files an export would not write is
refused. The directory and its files get the permissions the process's umask gives ordinary files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from tessera.checkpoint.hf.files import INDEX
from tessera.checkpoint.hf.names import check_exportable, fused_tensor, hf_copies, hf_fused_rows, hf_names, hf_parts
from tessera.checkpoint.hf.tokenizer import (
    TOKENIZER_FILES,
    check_vocabulary,
    resolve_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)
from tessera.config.errors import CheckpointError
from tessera.config.hf_config import config_to_hf
from tessera.config.model import ModelConfig
from tessera.models.transformer import Transformer

SINGLE_FILE = "model.safetensors"
_META = {"format": "pt"}

# Given the HuggingFace keys of one shard file (in model order), their tensors.
ShardReader = Callable[[list[str]], Mapping[str, torch.Tensor]]


def first_keys(keys: list[str] | set[str], n: int = 5) -> str:
    """The first `n` of `keys` (sorted) for an error message, and how many more there are."""
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (and {len(keys) - n} more)" if len(keys) > n else "")


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The keys of each shard file: in order, a new file when the next tensor would pass the limit
    (a tensor larger than the limit gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """`model.safetensors` alone, or `model-0000n-of-0000N.safetensors` with an index."""
    return [SINGLE_FILE] if count == 1 else [f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)]


def write_hf_directory(path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype, sizes: Mapping[str, int],
                       read_shard: ShardReader, max_shard_bytes: int = 5 * 2**30, tokenizer=None) -> list[str]:
    """Write `path` as a HuggingFace directory of model `cfg` with weights in `dtype`.

    `sizes` holds every HuggingFace key with its size in bytes, in model order; `read_shard(keys)`
    returns the tensors of one shard file, which are written and dropped before the next call.
    `tokenizer` (a `tessera.data.Tokenizer`, a tokenizer directory or file, "default" for the
    bundled one, or None) adds its files, special-token ids and chat template (tokenizer.py).
    Returns the names of the safetensors files written."""
    check_exportable(cfg)
    return write_hf_files(path, config_to_hf(cfg), cfg.vocab_size, dtype, sizes, read_shard, max_shard_bytes,
                          tokenizer)


def write_hf_files(path: str | os.PathLike, hf_cfg: dict, vocab_size: int, dtype: torch.dtype,
                   sizes: Mapping[str, int], read_shard: ShardReader, max_shard_bytes: int = 5 * 2**30,
                   tokenizer=None, extra_files: Mapping[str, str] | None = None) -> list[str]:
    """`write_hf_directory` for any config.json `hf_cfg` (a model of `vocab_size` tokens), with
    `extra_files` (file name -> text, e.g. an image processor's config) written beside it."""
    path = Path(path)
    tok = resolve_tokenizer(tokenizer)
    if tok is not None:
        check_vocabulary(tok, vocab_size)
    hf_cfg = hf_cfg | special_token_ids(tok)
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    shards = plan_shards(sizes, max_shard_bytes)
    if path.exists():
        foreign = sorted(p.name for p in path.iterdir() if not _is_export_file(p.name))
        if foreign:
            raise CheckpointError(f"{path} holds files a HuggingFace export would not write "
                                  f"({first_keys(foreign)}); save into a new or empty directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as e:
        raise _cannot_write(path, e) from None
    try:
        files = _write_shards(tmp, shards, sizes, read_shard)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        write_tokenizer_files(tmp, tok)
        _make_readable(tmp)
    except (OSError, SafetensorError) as e:  # a full disk, a quota, a file-size limit
        shutil.rmtree(tmp, ignore_errors=True)
        raise _cannot_write(path, e) from None
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
    return files


def _cannot_write(path: Path, error: Exception) -> CheckpointError:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else " ".join(str(error).split())
    return CheckpointError(f"{str(path)!r} cannot be written: {reason}; nothing was written there (free space "
                           "or choose another directory)")


def _write_shards(tmp: Path, shards: list[list[str]], sizes: Mapping[str, int], read_shard: ShardReader
                  ) -> list[str]:
    names = shard_file_names(len(shards))
    for fname, keys in zip(names, shards, strict=True):
        tensors = dict(read_shard(keys))
        if set(tensors) != set(keys):
            raise CheckpointError(f"writing {fname}: got tensors {first_keys(set(tensors) ^ set(keys))} "
                                  "other than the shard plan's")
        save_file(tensors, tmp / fname, metadata=_META)
        del tensors  # the next shard's tensors are read only after these are released
    if len(shards) > 1:
        weight_map = {k: fname for fname, keys in zip(names, shards, strict=True) for k in keys}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    return names


def _make_readable(directory: Path) -> None:
    """`mkdtemp` makes a private (0700) directory; give it and its files what the umask allows."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~mask)


def _is_export_file(name: str) -> bool:
    return name in ("config.json", "generation_config.json", "preprocessor_config.json", INDEX,
                    *TOKENIZER_FILES) or (
        name.startswith("model") and name.endswith(".safetensors"))


def _hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under their HuggingFace names, in model order (routed experts split,
    fused tensors joined)."""
    state, out, fused = model.state_dict(), {}, {}
    cut, rows = hf_parts(model.cfg), hf_fused_rows(model.cfg)
    for key, hf_keys in hf_names(model.cfg).items():
        t = state[key].detach().cpu()
        if key in cut:  # a part of a fused tensor (Llama 4's experts): joined below, in the first part's place
            fused.setdefault(hf_keys[0], []).append((cut[key], t))
            out.setdefault(hf_keys[0], None)
            continue
        if key in rows:  # rows of a fused tensor (Phi-3's qkv_proj / gate_up_proj), joined in model order
            out[hf_keys[0]] = torch.cat((out[hf_keys[0]], t)) if hf_keys[0] in out else t
            continue
        parts = [t] if len(hf_keys) == 1 else t.unbind(0)
        out.update({h: part.contiguous() for h, part in zip(hf_keys, parts, strict=True)})
    out.update({h: fused_tensor(parts) for h, parts in fused.items()})
    for h, key in hf_copies(model.cfg).items():  # DeepSeek-V3's MTP layers repeat the embedding and head
        out[h] = state[key].detach().cpu().clone()  # safetensors stores no two names over one storage
    return out


def save_pretrained(model: Transformer, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                    tokenizer=None) -> None:
    """Write config.json and safetensors (sharded above `max_shard_bytes`, with an index) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads, and with `tokenizer` (a
    `tessera.data.Tokenizer`, a tokenizer directory or file, or "default" for the bundled one) its
    files, special-token ids and chat template (tokenizer.py), so that `AutoTokenizer` and
    `tessera serve` read the directory alone. Written by `write_hf_directory`: crash-safe, with the
    permissions the process's umask gives ordinary files."""
    state = _hf_state(model)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    write_hf_directory(path, model.cfg, next(model.parameters()).dtype, sizes,
                       lambda keys: {k: state[k] for k in keys}, max_shard_bytes, tokenizer)
