"""Conversion between HuggingFace directories and Tessera checkpoints, and from GGUF files.

`convert` writes one format as the other: HF -> a checkpoint root holding `step_00000000/` (model
weights only; cut into the shards of a layout without loading the model: dcp/layout.py), Tessera ->
HF (read one safetensors file's tensors at a time, never the whole model: hf/export.py), GGUF -> HF
(dequantized, with the file's tokenizer: gguf/). A vision-language family's directory (LLaVA,
Qwen2-VL, Qwen2.5-VL: checkpoint/vision_families.py) converts to a checkpoint holding the whole
model and its image processor, and back (dcp/vision_language.py). Reading checks the files against
their recorded checksums first and unpickles nothing beyond plain data.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.vision_language import is_vision_language_checkpoint
from tessera.checkpoint.gguf.reader import is_gguf_path
from tessera.checkpoint.loading import trained_tokenizer
from tessera.checkpoint.vision_families import REGISTRY, directory_family, family_names, load_directory_model
from tessera.config.dtypes import short_dtype_argument, torch_dtype
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import is_hf_directory

DTYPES = {name: torch_dtype(name) for name in ("fp32", "bf16")}  # what a converted checkpoint is written in


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "fp32",
            tokenizer: str | os.PathLike | None = None, layout: list[str] | None = None,
            lora: str | None = None) -> tuple[str, Path]:
    """HF directory -> Tessera checkpoint root, Tessera checkpoint -> HF directory, or GGUF file ->
    HF directory (weights dequantized into `dtype`; `tokenizer` when given, else the file's own).

    Tessera -> HF reads a checkpoint saved under any parallel layout one shard file at a time
    (hf/export.py) and writes the tokenizer with the weights: `tokenizer` when given, else the
    run's `data.tokenizer` (the bundled one when that is unset). HF -> Tessera records the tokenizer
    (`tokenizer`, else the HF directory's own when it has one) as the checkpoint's data.tokenizer.
    Returns ("tessera" | "huggingface", what was written). `dst` must not be `src`.
    `layout` (`parallel.K=V` overrides, HF -> Tessera only) cuts the checkpoint's chunks into the
    shards of that layout without loading the whole model (dcp/layout.py).
    `lora` (a run trained with train.lora): "adapter" writes its adapters as a PEFT directory,
    "merge" the model with them merged as a HuggingFace directory (hf/peft.py); such a run's
    checkpoint converts only so.
    """
    dtype = short_dtype_argument(dtype)  # bfloat16 is bf16 (tessera.config.dtypes)
    if dtype not in DTYPES:
        raise CheckpointError(f"convert: dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    check_new_destination("convert", src, dst)
    created = not Path(dst).exists()
    try:
        if lora is not None:
            return _convert_lora(src, dst, dtype, tokenizer, layout, lora)
        return _convert(src, dst, dtype, tokenizer, layout)
    except BaseException:
        if created:  # nothing partial is left: the directory was this call's
            shutil.rmtree(dst, ignore_errors=True)
        raise


def _convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str, tokenizer: str | os.PathLike | None,
             layout: list[str] | None) -> tuple[str, Path]:
    """`convert` once its destination is known to be new or empty and writable."""
    if is_gguf_path(src):
        return "huggingface", _gguf_to_hf(src, dst, dtype, tokenizer, layout)
    if directory_family(src) is not None or (not is_hf_directory(src) and is_vision_language_checkpoint(src)):
        return _convert_vision_language(src, dst, dtype, tokenizer, layout)
    if is_hf_directory(src):
        own = trained_tokenizer(src)
        source = tokenizer or (str(Path(own).resolve()) if own is not None else None)
        recorded = None if source is None else str(source)
        if layout:
            from tessera.checkpoint.dcp.layout import save_layout_checkpoint

            return "tessera", save_layout_checkpoint(src, dst, layout, DTYPES[dtype], recorded)
        from tessera.checkpoint.dcp.model import save_model_checkpoint
        from tessera.checkpoint.hf.load import load_pretrained

        model = load_pretrained(src, dtype=DTYPES[dtype])
        return "tessera", save_model_checkpoint(model, dst, tokenizer=recorded)
    if layout:
        raise ConfigError("convert --set parallel.* applies to HuggingFace -> Tessera only: a HuggingFace "
                          "export has no layout")
    from tessera.checkpoint.hf.export import export_checkpoint_to_hf
    from tessera.checkpoint.hf.peft import stored_lora

    found = ckpt.resolve_checkpoint(src)  # saved under any layout; read one shard file at a time
    if stored_lora(found).enabled:
        raise ConfigError(f"{str(src)!r} was trained with train.lora: convert it with --lora-adapter (a PEFT adapter "
                          "directory over its base) or --merge-lora (a HuggingFace directory with the adapters merged)")
    export_checkpoint_to_hf(found, dst, dtype=DTYPES[dtype], tokenizer=tokenizer or trained_tokenizer(found))
    return "huggingface", Path(dst)


def _convert_lora(src: str | os.PathLike, dst: str | os.PathLike, dtype: str, tokenizer: str | os.PathLike | None,
                  layout: list[str] | None, lora: str) -> tuple[str, Path]:
    """A LoRA run's checkpoint -> its PEFT adapter directory ("adapter") or its merged model ("merge")."""
    if lora not in ("adapter", "merge"):
        raise ConfigError(f"convert: lora={lora!r} is invalid: adapter (--lora-adapter) or merge (--merge-lora)")
    if layout:
        raise ConfigError("convert --set parallel.* applies to HuggingFace -> Tessera only: --lora-adapter and "
                          "--merge-lora write HuggingFace / PEFT directories, which have no layout")
    if is_hf_directory(src) or is_gguf_path(src):
        raise ConfigError(f"convert --lora-adapter / --merge-lora read a run trained with train.lora; {str(src)!r} "
                          "is a model file or directory, not a run")
    from tessera.checkpoint.hf.peft import write_merged_lora, write_peft_adapter

    found = ckpt.resolve_checkpoint(src)
    if lora == "adapter":
        return "peft", write_peft_adapter(found, dst, DTYPES[dtype])
    return "huggingface", write_merged_lora(found, dst, DTYPES[dtype], tokenizer or trained_tokenizer(found))


def _convert_vision_language(src: str | os.PathLike, dst: str | os.PathLike, dtype: str,
                             tokenizer: str | os.PathLike | None, layout: list[str] | None) -> tuple[str, Path]:
    """A vision-language family's directory (LLaVA, Qwen2-VL, Qwen2.5-VL) <-> a Tessera checkpoint
    (dcp/vision_language.py), image processor included."""
    family = directory_family(src)
    if layout:
        raise ConfigError(f"convert --set parallel.* is not supported for vision-language models "
                          f"({', '.join(family_names(family))}): the checkpoint is written whole; give no --set")
    from tessera.checkpoint.dcp.vision_language import (
        load_vision_language_checkpoint,
        save_vision_language_checkpoint,
    )

    if family is not None:
        model, processor = load_directory_model(src, DTYPES[dtype])
        own = trained_tokenizer(src)
        source = tokenizer or (str(Path(own).resolve()) if own is not None else None)
        recorded = None if source is None else str(source)
        return "tessera", save_vision_language_checkpoint(model, dst, processor, recorded)
    model, processor, run_config = load_vision_language_checkpoint(src, DTYPES[dtype])
    # a vision-language run's own (its entry names it); else the source directory's own, or none
    recorded = (ckpt.read_meta(ckpt.resolve_checkpoint(src)).get("vision_language", {}).get("tokenizer")
                or (run_config.get("data") or {}).get("tokenizer"))
    REGISTRY[model.family].directory.save(model, dst, tokenizer=tokenizer or recorded, processor=processor)
    return "huggingface", Path(dst)


def check_new_destination(command: str, src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Refuse (CheckpointError) a destination that is the source, a file, a non-empty directory, or
    cannot be written: `command` writes a whole new directory there."""
    if Path(src).resolve() == Path(dst).resolve():
        raise CheckpointError(f"{command}: destination {str(dst)!r} is the source; choose another directory")
    if Path(dst).exists() and not Path(dst).is_dir():
        raise CheckpointError(f"{command}: destination {str(dst)!r} is a file; give a new directory")
    if Path(dst).exists() and any(Path(dst).iterdir()):
        raise CheckpointError(f"{command}: destination {str(dst)!r} is not empty; choose a new directory "
                              "(writing into a run's checkpoints would take over its `latest`)")
    if not os.access(_nearest_existing(Path(dst)), os.W_OK):
        raise CheckpointError(f"{command}: destination {str(dst)!r} cannot be written (read-only or no "
                              "permission); choose a writable directory")


def _gguf_to_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: str, tokenizer: str | os.PathLike | None,
                layout: list[str] | None) -> Path:
    """GGUF file -> HuggingFace directory, by the one writer (`save_pretrained`)."""
    if layout:
        raise ConfigError("convert --set parallel.* applies to HuggingFace -> Tessera only: a GGUF file converts to "
                          "a HuggingFace directory; convert that directory with --set next")
    from tessera.checkpoint.gguf import gguf_tokenizer, load_gguf
    from tessera.checkpoint.hf.writer import save_pretrained

    model = load_gguf(src, dtype=DTYPES[dtype])
    save_pretrained(model, dst, tokenizer=tokenizer or gguf_tokenizer(src))
    return Path(dst)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (where a new directory would be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
