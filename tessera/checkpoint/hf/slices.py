"""Reading from a HuggingFace directory only the part of each tensor that one rank owns.

A parallelized model's parameter is a DTensor: its global shape is the whole tensor's, and the
rank holds one box of it (an offset and a size per dimension; tensor, expert and data parallelism
all cut contiguous boxes, nested cuts included). `local_box(t)` is that box (the whole tensor for
a plain tensor), the same box `torch.distributed.checkpoint` records for the shard.
`HFSliceReader.read(key, offsets, sizes)` reads exactly that box of the Tessera tensor `key` from
the safetensors files, with safetensors' lazy `get_slice`:

    reader = HFSliceReader(hf_dir, cfg)
    for name, p in part.named_parameters():
        offsets, sizes = local_box(p)
        local = reader.read(name, offsets, sizes, dtype=torch.float32)

Names follow `names.hf_names` (in a vision-language directory, its language model's as its family
names them: tessera/checkpoint/vision_families.py); routed
experts are E HuggingFace tensors stacked as one
[E, out, in] tensor in Tessera, so a box over experts [e0, e0 + n) reads only those n files'
tensors, each cut to the box's other dimensions; a tensor stored as rows of a fused one (Phi-3's
qkv_proj, Qwen3.5 MoE's packed experts) is read as a box at its rows' offset. `bytes_read` counts the
bytes of every box read (what this rank took from the files), which is how a test proves a rank read
about its share.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from tessera.checkpoint.hf.files import SafetensorsDir
from tessera.checkpoint.hf.mxfp4 import Mxfp4Tensors
from tessera.checkpoint.hf.names import hf_fused_rows, hf_names, hf_names_in, hf_parts, hf_unpacked
from tessera.checkpoint.prequantized.detect import refuse_prequantized
from tessera.checkpoint.vision_families import directory_family
from tessera.config.errors import CheckpointError
from tessera.config.model import ModelConfig
from tessera.models.lazy_torch import is_dtensor


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of the part of `t` this rank holds: a DTensor's local shard
    (any placements DCP can save), or the whole of a plain tensor."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    return (0,) * t.dim(), tuple(t.shape)


class HFSliceReader:
    """Boxes of Tessera tensors read from the safetensors of HuggingFace directory `path`."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig):
        self.path, self.cfg = Path(path), cfg
        refuse_prequantized(self.path)  # its tensors are codes and scales, not the model's weights
        self.names = hf_names(cfg)
        self.parts = hf_parts(cfg)  # Tessera tensors cut from a fused HuggingFace one (Llama 4's experts)
        self.rows = hf_fused_rows(cfg)  # Tessera key -> its rows of a fused HuggingFace tensor
        self.files = SafetensorsDir(self.path)
        # a vision-language directory names its language model's tensors its own way (its family's
        # names: llava.py, qwen_vl.py, qwen3_5_vl.py); a text model reads them by those names
        family = directory_family(self.path)
        stored = set(self.files.keys())

        def in_directory(names: dict[str, list[str]]) -> dict[str, list[str]]:
            return names if family is None else family.directory.language_model_names(names, stored)[0]

        self.names = in_directory(hf_names_in(cfg, stored))
        for key, unpacked in in_directory(hf_unpacked(cfg)).items():  # one tensor per expert (Qwen3.5 MoE's save)
            if self.names[key][0] not in self.files.files and unpacked[0] in self.files.files:
                self.names[key] = unpacked
                del self.parts[key]
        # MXFP4 pairs (gpt-oss's experts, mxfp4.py) stand in for their plain tensors, dequantized on read
        self.mxfp4 = Mxfp4Tensors(self.files.keys(), lambda k, o, n: self._slice(k, o, n, codes=True))
        self.packed = {k: self.files.files.pop(k) for pair in self.mxfp4.pairs.values() for k in pair}
        self.files.files.update({plain: self.packed[pair[0]] for plain, pair in self.mxfp4.pairs.items()})
        self.bytes_read = 0
        # stored tensors that belong to no part of this model: a vision-language directory's image side
        used = {h for hs in self.names.values() for h in hs}
        self.foreign: set[str] = set() if family is None else {k for k in self.files.keys() if k not in used}

    def _slice(self, hf_key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], codes: bool = False
               ) -> torch.Tensor:
        """The box of stored tensor `hf_key` (an MXFP4 pair's plain name: dequantized); `codes`: an
        MXFP4 pair's own uint8 tensor."""
        if not codes and hf_key in self.mxfp4.pairs:
            return self.mxfp4.read(hf_key, offsets, sizes, self._stored_shape)
        f = self.packed[hf_key] if codes else self.files.files[hf_key]
        handle = self.files.handle(f)
        try:
            view = handle.get_slice(hf_key)
            shape = tuple(view.get_shape())
            if len(shape) != len(sizes) or any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
                raise CheckpointError(f"{str(f)!r}: tensor {hf_key!r} has shape {shape}; the model needs the box "
                                      f"at {offsets} of size {sizes} of it (does config.json match the weights?)")
            t = view[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{str(f)!r}: cannot read tensor {hf_key!r} ({e}); the file may be damaged") from e
        finally:  # each read's file pages are let go at once: reading a model costs one tensor's, not the file's
            self.files.release(f)
        if not t.is_floating_point() and not codes:
            raise CheckpointError(f"{str(f)!r}: tensor {hf_key!r} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                  "model weights must be floating point (float32, bfloat16, float16)")
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole shape of Tessera tensor `key` as stored (routed experts: [E, ...]), from the
        files' headers; no data is read."""
        hf_keys = self.names[key]
        shape = self._stored_shape(hf_keys[0])
        if key in self.parts and not self.parts[key].transposed:  # [..., count * out, in] -> [..., out, in]
            return (*shape[:-2], shape[-2] // self.parts[key].count, shape[-1])
        if key in self.parts:  # [..., in, count * out] -> [..., out, in]
            return (*shape[:-2], shape[-1] // self.parts[key].count, shape[-2])
        if key in self.rows:
            start, stop = self.rows[key]
            return (stop - start, *shape[1:])
        return shape if len(hf_keys) == 1 else (len(hf_keys), *shape)

    def _stored_shape(self, hf_key: str) -> tuple[int, ...]:
        if hf_key in self.mxfp4.pairs:
            return self.mxfp4.stored_shape(hf_key, self._stored_shape)
        f = self.files.files.get(hf_key) or self.packed[hf_key]
        try:
            return tuple(self.files.handle(f).get_slice(hf_key).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{str(f)!r}: cannot read tensor {hf_key!r} ({e}); the file may be damaged") from e

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The box (`offsets`, `sizes`) of Tessera tensor `key`, in `dtype` (default: as stored)."""
        if key not in self.names:
            raise CheckpointError(f"{self.path}: the model has a tensor {key!r} that no HuggingFace tensor maps to")
        hf_keys = self.names[key]
        if key in self.parts and not self.parts[key].transposed:  # the box at its part's rows
            at = self.parts[key].index * self.shape(key)[-2] + offsets[-2]
            t = self._slice(hf_keys[0], (*offsets[:-2], at, offsets[-1]), sizes)
        elif key in self.parts:  # the box of the transposed part: its rows are columns of the fused tensor
            out = self.shape(key)[-2]
            at = self.parts[key].index * out + offsets[-2]
            t = self._slice(hf_keys[0], (*offsets[:-2], offsets[-1], at), (*sizes[:-2], sizes[-1], sizes[-2]))
            t = t.transpose(-1, -2).contiguous()
        elif key in self.rows:  # rows of a fused tensor
            t = self._slice(hf_keys[0], (offsets[0] + self.rows[key][0], *offsets[1:]), sizes)
        elif len(hf_keys) == 1:
            t = self._slice(hf_keys[0], offsets, sizes)
        else:  # routed experts: one HF tensor per expert along dim 0
            first, count = offsets[0], sizes[0]
            if first + count > len(hf_keys):
                raise CheckpointError(f"{self.path}: {key!r} needs experts [{first}, {first + count}) but the "
                                      f"checkpoint maps {len(hf_keys)}")
            t = torch.stack([self._slice(hf_keys[j], offsets[1:], sizes[1:]) for j in range(first, first + count)])
        return t if dtype is None else t.to(dtype)
