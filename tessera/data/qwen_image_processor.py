"""Qwen2-VL's image processor (Qwen2.5-VL uses the same): any image size in, its patches out.

`QwenImageProcessor` reads the `preprocessor_config.json` of a Qwen2-VL / Qwen2.5-VL directory and
applies, in transformers' `Qwen2VLImageProcessorPil` order: RGB conversion (transparency
composited over white), a resize with Pillow's filter to `smart_resize`'s size (each side a
multiple of patch_size x merge_size, the pixel count within [min_pixels, max_pixels], the aspect
ratio kept as closely as that allows), rescale (float64, then float32), normalization (float32),
and patch flattening: the image is cut into patch_size squares, repeated `temporal_patch_size`
times (a still image is a clip of identical frames), and the patches of each merge x merge block
written consecutively, a row of C x T x patch_size^2 values each. `__call__` returns those rows
and the grid (1, h, w) in patches: `pixel_values` and `image_grid_thw`, equal to transformers'
for the same Pillow image. The number of placeholder tokens an image takes is known from its size
alone (`image_tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image

from tessera.config.errors import ConfigError, ImageError
from tessera.config.qwen_vl import QWEN3_TOWERS, QwenVisionConfig
from tessera.data.image_processor import (
    BICUBIC,
    CLIP_MEAN,
    CLIP_STD,
    PROCESSOR_FILE,
    ImageProcessorFile,
    _resize,
    check_filter_and_statistics,
    image_array,
    rescale_and_normalize,
)

TYPE = "Qwen2VLImageProcessor"
MAX_ASPECT = 200  # the longest side over the shortest; transformers refuses more


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after resizing: multiples of `factor`, area within [min_pixels, max_pixels]
    where rounding allows, aspect ratio about the original's."""
    if min(height, width) < 1:
        raise ImageError(f"the image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"the image is {width}x{height}: its aspect ratio is over {MAX_ASPECT}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class QwenImageProcessor(ImageProcessorFile):
    """The fields of a Qwen2-VL `preprocessor_config.json` that decide the pixel values."""

    image_processor_type: str = TYPE
    do_convert_rgb: bool = True
    do_resize: bool = True
    size: dict[str, int] = field(default_factory=lambda: {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(CLIP_STD))
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @property
    def min_pixels(self) -> int:
        return self.size["shortest_edge"]

    @property
    def max_pixels(self) -> int:
        return self.size["longest_edge"]

    @classmethod
    def for_vision(cls, vision: QwenVisionConfig) -> QwenImageProcessor:
        """The processor with the tower's patch sizes and Qwen's default pixel range; a tower of
        Qwen3-VL's kind normalizes by mean and std 0.5 (transformers' Qwen3-VL processors), the
        others by CLIP's."""
        stats = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if vision.version in QWEN3_TOWERS else {}
        return cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size, **stats)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = PROCESSOR_FILE) -> QwenImageProcessor:
        kind = str(d.get("image_processor_type", "")).removesuffix("Pil").removesuffix("Fast")
        if kind != TYPE:
            raise ConfigError(f"{source}: image_processor_type={d.get('image_processor_type')!r} is not supported "
                              f"for Qwen2-VL; allowed: {TYPE}")
        base = asdict(cls())
        known = {k: d[k] for k in base if k in d and d[k] is not None}
        size = {k: v for k, v in dict(known.get("size") or base["size"]).items() if v is not None}
        for old, new in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):  # older files' keys
            if d.get(old) is not None:
                size[new] = d[old]
            if old in size:
                size[new] = size.pop(old)
        known["size"] = size
        return cls.from_fields(base, known, TYPE, source)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

    def check(self, source: str) -> None:
        s = self.size
        if (set(s) != {"shortest_edge", "longest_edge"} or not all(isinstance(v, int) and v > 0 for v in s.values())
                or s["shortest_edge"] > s["longest_edge"]):
            raise ConfigError(f"{source}: size {s!r} is invalid: {{'shortest_edge': min_pixels, 'longest_edge': "
                              "max_pixels}, positive integers, min <= max")
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{source}: {key}={getattr(self, key)!r} must be a positive integer")
        check_filter_and_statistics(self, source)

    def check_tower(self, vision: QwenVisionConfig, source: str) -> None:
        """A ConfigError unless this processor cuts the patches `vision` takes."""
        mine = (self.patch_size, self.temporal_patch_size, self.merge_size)
        theirs = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        if mine != theirs:
            raise ConfigError(f"{source}: (patch_size, temporal_patch_size, merge_size) = {mine} but the vision "
                              f"tower takes {theirs}")

    def with_pixel_range(self, min_pixels: int | None, max_pixels: int | None, source: str) -> QwenImageProcessor:
        """This processor keeping each image's area within [min_pixels, max_pixels] (None: its own
        bound), checked."""
        size = {"shortest_edge": min_pixels or self.min_pixels, "longest_edge": max_pixels or self.max_pixels}
        out = replace(self, size=size)
        out.check(f"{source} (min_pixels, max_pixels)")
        return out

    # ---- the pipeline --------------------------------------------------------------------------
    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            factor = self.patch_size * self.merge_size
            if height % factor or width % factor:
                raise ImageError(f"the image is {width}x{height}, not a multiple of {factor} a side, and the "
                                 "processor does not resize")
            return height, width
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of this size."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of this size takes in the prompt."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size**2

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patch rows [h x w, C x T x patch_size^2] float32 and the grid (1, h, w) of one decoded image."""
        pixels = image_array(image, self.do_convert_rgb)
        size = self.resized_size(pixels.shape[0], pixels.shape[1])
        if self.do_resize:
            pixels = _resize(pixels, size, self.resample)
        return self.patchify(rescale_and_normalize(np.moveaxis(pixels, -1, 0), self))

    def patchify(self, chw: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        C, H, W = chw.shape
        p, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = H // p, W // p
        x = chw.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, patch, C, pixels
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, p, p))  # the frame repeated in time
        return np.ascontiguousarray(x.reshape(gh * gw, C * T * p * p), dtype=np.float32), (1, gh, gw)

    def batch(self, images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """`pixel_values` [sum of patches, row] and `image_grid_thw` [N, 3] of several images."""
        rows, grids = zip(*(self(im) for im in images), strict=True) if images else ((), ())
        values = np.concatenate(rows) if rows else np.zeros((0, 3 * self.temporal_patch_size * self.patch_size**2),
                                                             dtype=np.float32)
        return values, np.array(grids, dtype=np.int64).reshape(-1, 3)
