"""A HuggingFace directory from a Tessera checkpoint, read one shard file at a time.

    result = export_checkpoint_to_hf("runs/tiny-moe", "out/hf", dtype=torch.bfloat16, tokenizer="default")
    result.files, result.peak_bytes      # the safetensors files written; most tensor bytes held at once

The checkpoint may come from any parallel layout (one process, FSDP, tp x ep, pipeline stages,
...): DCP stores every tensor under its parameter name (`model.<name>`) with its global shape, and
`dcp.load_boxes` reads any box of it in this process alone, from whichever ranks' shards overlap
it. So the whole model is never built nor held: the files are checked against their checksums,
the model shape comes from the run configuration in meta.json, the stored names and shapes are
checked against it, and then, for each shard file of the plan (writer.py, the same plan, names
and index as `save_pretrained`), exactly that file's tensors are read, cast to `dtype` (but for the
routing bias, which stays fp32 as in a loaded model: `kept_in_fp32`), written and released. A
routed-expert weight [E, out, in] is E HuggingFace tensors: a file gets the box of the experts it
holds, never the others.

`peak_bytes` is measured, not computed, and counts the tensors the export writes: each is counted
from its allocation (in the exported dtype) until it is garbage collected, so it is at most one
shard file's worth (or one tensor, when a tensor is larger than `max_shard_bytes`). It leaves out
DCP's own reading: for each stored chunk (a rank's shard of a tensor) that overlaps a tensor being
read, DCP loads the whole chunk, in its stored dtype (fp32 for a training checkpoint), copies the
overlap out and drops it before the next chunk, so the process holds up to one stored chunk
more, briefly. Saved by one process, a chunk is a whole tensor: the fp32 embedding, or every expert
of a stacked expert weight even when the file being written takes a few of them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import stored_model_config
from tessera.checkpoint.hf.names import check_exportable, fused_tensor, hf_copies, hf_fused_rows, hf_names, hf_parts
from tessera.checkpoint.hf.writer import write_hf_directory
from tessera.config.errors import CheckpointError
from tessera.config.model import ModelConfig
from tessera.models.transformer import Transformer, kept_in_fp32

MODEL_PREFIX = "model."  # training checkpoints keep the weights under "model" (tessera/train/run/train_checkpoint.py)


@dataclass
class ExportResult:
    """What `export_checkpoint_to_hf` wrote."""

    path: Path  # the HuggingFace directory
    checkpoint: Path  # the checkpoint it was read from
    files: list[str]  # its safetensors files, in order
    total_bytes: int  # tensor bytes written
    peak_bytes: int  # most bytes of the written tensors held at once (not DCP's chunk reads: module docstring)


class _ShardReader:
    """The HuggingFace tensors of one shard file at a time, read as boxes of the stored tensors."""

    def __init__(self, checkpoint: Path, cfg: ModelConfig, dtype: torch.dtype, shapes: Mapping[str, tuple[int, ...]]):
        self.checkpoint, self.dtype, self.shapes = checkpoint, dtype, shapes
        self.source: dict[str, tuple[str, int | None]] = {}  # HF key -> (Tessera key, expert index or None)
        self.parts = hf_parts(cfg)  # Llama 4's experts: Tessera tensors cut from a fused HF tensor's columns
        rows = hf_fused_rows(cfg)  # Phi-3's qkv_proj / gate_up_proj: Tessera tensors as a fused HF tensor's rows
        self.fused: dict[str, list[str]] = {}  # fused HF key -> its Tessera parts, in model order
        for key, hf_keys in hf_names(cfg).items():
            if key in self.parts or key in rows:
                self.fused.setdefault(hf_keys[0], []).append(key)
            for j, h in enumerate(hf_keys):
                self.source[h] = (key, j if len(hf_keys) > 1 else None)
        self.copies = hf_copies(cfg)  # DeepSeek-V3's MTP layers repeat the embedding and head
        for h, key in self.copies.items():
            self.source[h] = (key, None)
        self.held = 0
        self.peak_bytes = 0

    def dtype_of(self, key: str) -> torch.dtype:
        return torch.float32 if kept_in_fp32(key) else self.dtype

    def size(self, hf_key: str) -> int:
        if hf_key in self.fused:
            return sum(torch.Size(self.shapes[k]).numel() * self.dtype_of(k).itemsize for k in self.fused[hf_key])
        key, j = self.source[hf_key]
        shape = self.shapes[key][1:] if j is not None else self.shapes[key]
        return torch.Size(shape).numel() * self.dtype_of(key).itemsize

    def __call__(self, hf_keys: list[str]) -> dict[str, torch.Tensor]:
        wanted: dict[str, list[int | None]] = {}  # Tessera key -> expert indices (contiguous, in order)
        for h in hf_keys:
            for key in self.fused.get(h, [self.source[h][0]]):
                wanted.setdefault(key, []).append(None if h in self.fused else self.source[h][1])
        boxes, first = {}, {}
        for key, indices in wanted.items():
            shape = self.shapes[key]
            if indices[0] is None:
                offsets, box = (0,) * len(shape), shape
            else:
                first[key] = indices[0]
                offsets, box = (indices[0],) + (0,) * (len(shape) - 1), (len(indices), *shape[1:])
            boxes[MODEL_PREFIX + key] = (offsets, self._allocate(box, self.dtype_of(key)))
        ckpt.load_boxes(self.checkpoint, boxes)
        out = {}
        for h in hf_keys:
            if h in self.fused:  # joined from its parts' whole tensors (counted as one more tensor held)
                parts = self.fused[h]
                if parts[0] in self.parts:  # columns of the parts transposed (Llama 4's experts)
                    out[h] = self._held(fused_tensor([(self.parts[k], boxes[MODEL_PREFIX + k][1]) for k in parts]))
                else:  # the parts' rows in order (Phi-3)
                    out[h] = self._held(torch.cat([boxes[MODEL_PREFIX + k][1] for k in parts]))
                continue
            key, j = self.source[h]
            t = boxes[MODEL_PREFIX + key][1]
            out[h] = t if j is None else t[j - first[key]]  # a view: keeps its box alive until written
            if h in self.copies:
                out[h] = t.clone()  # safetensors stores no two names over one storage
        return out

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._held(torch.empty(shape, dtype=dtype))

    def _held(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t` among the bytes held until it is garbage collected."""
        self.held += t.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held)
        weakref.finalize(t, self._release, t.nbytes)
        return t

    def _release(self, nbytes: int) -> None:
        self.held -= nbytes


def export_checkpoint_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                            dtype: torch.dtype = torch.float32, tokenizer=None,
                            max_shard_bytes: int = 5 * 2**30) -> ExportResult:
    """Write the model of a Tessera run directory / checkpoint root / checkpoint, saved under any
    parallel layout, as a HuggingFace directory `out_dir`, as `save_pretrained` would write the
    loaded model in `dtype`, without loading it: one shard file's tensors at a time.

    `tokenizer` as for `save_pretrained` (a Tokenizer, a path, "default", or None: no tokenizer
    files). A damaged checkpoint (a file that does not match its checksum, ...) is a
    CheckpointError naming the file; the refusal rules and crash safety are `save_pretrained`'s:
    a failed export leaves any earlier `out_dir` as it was."""
    found = ckpt.verified(ckpt.resolve_checkpoint(checkpoint))
    if isinstance(ckpt.read_meta(found).get("vision_language"), dict):  # a vision-language run: written whole
        return _export_vision_language(found, out_dir, dtype, tokenizer, max_shard_bytes)
    cfg = stored_model_config(found)
    check_exportable(cfg)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg, init_seed=None).state_dict().items()}
    ckpt.check_compatible(found, MODEL_PREFIX.rstrip("."), shapes)
    reader = _ShardReader(found, cfg, dtype, shapes)
    sizes = {h: reader.size(h) for h in reader.source}
    try:
        files = write_hf_directory(out_dir, cfg, dtype, sizes, reader, max_shard_bytes, tokenizer)
    except OSError as e:  # a full disk, a read-only file system: the export is removed, out_dir untouched
        raise CheckpointError(f"cannot write {str(out_dir)!r}: {e.strerror or e}") from e
    return ExportResult(Path(out_dir), found, files, sum(sizes.values()), reader.peak_bytes)


def _export_vision_language(found: Path, out_dir: str | os.PathLike, dtype: torch.dtype, tokenizer,
                            max_shard_bytes: int) -> ExportResult:
    """A vision-language checkpoint (tessera.checkpoint.dcp.vision_language) as its family's directory
    (LLaVA, Qwen2-VL, Qwen2.5-VL): the model is loaded whole (these are small models) and written by
    its family's writer (tessera.checkpoint.vision_families)."""
    from tessera.checkpoint.dcp.vision_language import load_vision_language_checkpoint
    from tessera.checkpoint.vision_families import REGISTRY

    model, processor, _ = load_vision_language_checkpoint(found, dtype)
    try:
        REGISTRY[model.family].directory.save(model, out_dir, tokenizer=tokenizer, processor=processor,
                                              max_shard_bytes=max_shard_bytes)
    except OSError as e:
        raise CheckpointError(f"cannot write {str(out_dir)!r}: {e.strerror or e}") from e
    files = sorted(p.name for p in Path(out_dir).glob("*.safetensors"))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return ExportResult(Path(out_dir), found, files, total, total)
