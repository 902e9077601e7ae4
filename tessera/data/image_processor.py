"""Images: decoded by Pillow as untrusted input, then turned into a vision tower's pixel values
exactly as HuggingFace's CLIP and SigLIP image processors (the Pillow ones) do.

`decode_image(data)` opens encoded bytes and refuses, with an `ImageError` naming the problem, what
is not an image, a truncated file, an image of zero size (Pillow does not identify one: the message
says both), and one whose pixel count passes
Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`), checked from the header before any
pixel is decoded. `ImageProcessor` reads a `preprocessor_config.json` and applies, in the
processors' order: RGB conversion (transparency composited over white), resize (Pillow's filter:
the shortest edge to `size.shortest_edge` with the long side scaled and truncated, or to
`size.height x size.width`), center crop (zero padding where the image is smaller), rescale (in
float64, then float32) and normalization (in float32). The output is [C, H, W] float32, equal to
`CLIPImageProcessorPil` / `SiglipImageProcessorPil` bit for bit.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from tessera.config.errors import ConfigError, ImageError
from tessera.config.vision import VisionConfig

PROCESSOR_FILE = "preprocessor_config.json"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # OpenAI CLIP's training statistics
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]  # SigLIP: [0, 1] -> [-1, 1]
TYPES = ("CLIPImageProcessor", "SiglipImageProcessor")
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, both processors' filter


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """The image encoded in `data`, fully decoded; `max_pixels` defaults to Pillow's bomb limit."""
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError("the data is not an image Pillow can read (PNG, JPEG, GIF, WebP, BMP, ...), or an image "
                         "of zero width or height") from None
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more pixels than the limit of {limit:,} (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"the image data is damaged or truncated ({type(e).__name__})") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"the image has zero size ({width}x{height})")
    if limit is not None and width * height > limit:
        raise ImageError(f"the image is {width}x{height} = {width * height:,} pixels, over the limit of {limit:,} "
                         "(a decompression bomb?)")
    try:
        image.load()
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more pixels than the limit of {limit:,} (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        reason = "truncated" if "truncated" in str(e) else type(e).__name__
        raise ImageError(f"the image data is damaged or truncated ({reason})") from None
    return image


class ImageProcessorFile:
    """What every vision-language family's image processor shares: read from a directory's
    `preprocessor_config.json` (`from_directory`, through the class's `from_dict`) and built from
    the file's fields (`from_fields`). A family's processor (a dataclass of the file's fields, this
    module's and tessera/data/qwen_image_processor.py's) also has `for_vision(vision)` (the one the
    tower ships with), `to_dict()`, `check(source)`, `check_tower(vision, source)` (it makes what
    the tower takes), `with_pixel_range(min_pixels, max_pixels, source)` and `__call__(image)` (its
    pixel values): what tessera/checkpoint/vision_families.py, serving and training ask of it."""

    @classmethod
    def from_fields(cls, base: dict[str, Any], known: dict[str, Any], kind: str, source: str) -> Any:
        """The processor of fields `base` (its defaults) with the file's `known` ones (its JSON
        arrays as lists) and type `kind`, checked (`check`, naming `source`)."""
        for key in ("image_mean", "image_std"):
            if isinstance(known.get(key), tuple):
                known[key] = list(known[key])
        proc = cls(**{**base, **known, "image_processor_type": kind})
        proc.check(source)
        return proc

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Any:
        return cls.from_dict(*read_processor_file(path))


@dataclass
class ImageProcessor(ImageProcessorFile):
    """The fields of a CLIP / SigLIP `preprocessor_config.json` that decide the pixel values."""

    image_processor_type: str = "CLIPImageProcessor"  # one of TYPES
    do_convert_rgb: bool = True
    do_resize: bool = True
    size: dict[str, int] = field(default_factory=lambda: {"shortest_edge": 224})  # or {"height", "width"}
    resample: int = BICUBIC
    do_center_crop: bool = True
    crop_size: dict[str, int] = field(default_factory=lambda: {"height": 224, "width": 224})
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(CLIP_STD))

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> ImageProcessor:
        """The processor a CLIP / SigLIP tower of this input size ships with."""
        side = vision.image_size
        if vision.kind == "siglip":
            return cls(image_processor_type="SiglipImageProcessor", size={"height": side, "width": side},
                       do_center_crop=False, crop_size={}, image_mean=list(HALF), image_std=list(HALF))
        return cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = PROCESSOR_FILE) -> ImageProcessor:
        kind = str(d.get("image_processor_type", "")).removesuffix("Pil").removesuffix("Fast")
        if kind not in TYPES:
            raise ConfigError(f"{source}: image_processor_type={d.get('image_processor_type')!r} is not supported; "
                              f"allowed: {', '.join(TYPES)}")
        base = asdict(cls()) if kind == "CLIPImageProcessor" else asdict(cls.for_vision(VisionConfig(
            kind="siglip", image_size=224, patch_size=16)))
        known = {k: d[k] for k in base if k in d and d[k] is not None}
        for key in ("size", "crop_size"):  # transformers may write every size key, the unused ones null
            if isinstance(known.get(key), dict):
                known[key] = {k: v for k, v in known[key].items() if v is not None}
        return cls.from_fields(base, known, kind, source)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.do_center_crop:
            d.pop("crop_size")
        return d

    def check(self, source: str) -> None:
        sizes = [self.size] + ([self.crop_size] if self.do_center_crop else [])
        for s in sizes:
            if not isinstance(s, dict) or not (set(s) == {"shortest_edge"} or set(s) == {"height", "width"}) or not all(
                    isinstance(v, int) and v > 0 for v in s.values()):
                raise ConfigError(f"{source}: size {s!r} is invalid: {{'shortest_edge': N}} or "
                                  "{'height': H, 'width': W} with positive integers")
        if self.do_center_crop and set(self.crop_size) != {"height", "width"}:
            raise ConfigError(f"{source}: crop_size {self.crop_size!r} needs height and width")
        check_filter_and_statistics(self, source)

    def check_tower(self, vision: VisionConfig, source: str) -> None:
        """A ConfigError unless this processor makes the tower's input size."""
        side = vision.image_size
        if self.output_size() != (side, side):
            raise ConfigError(f"{source!r} makes {self.output_size()} images but the vision tower takes ({side}, "
                              f"{side})")

    def with_pixel_range(self, min_pixels: int | None, max_pixels: int | None, source: str) -> ImageProcessor:
        """Refused: every image is resized to the tower's size (a pixel range is Qwen's processor's)."""
        raise ConfigError(f"{source}.min_pixels / max_pixels apply to Qwen2-VL / Qwen2.5-VL models; LLaVA's processor "
                          "resizes every image to the tower's size: leave them null")

    def output_size(self) -> tuple[int, int]:
        """(height, width) of every output, when it does not depend on the image; else a ConfigError."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        raise ConfigError("the image processor's output size depends on the image (no crop, no fixed size)")

    # ---- the pipeline --------------------------------------------------------------------------
    def __call__(self, image: Image.Image) -> np.ndarray:
        """Pixel values [C, H, W] float32 of one decoded image."""
        pixels = image_array(image, self.do_convert_rgb)
        if self.do_resize:
            pixels = _resize(pixels, self._resized_size(pixels.shape[0], pixels.shape[1]), self.resample)
        chw = np.moveaxis(pixels, -1, 0)
        if self.do_center_crop:
            chw = _center_crop(chw, self.crop_size["height"], self.crop_size["width"])
        return rescale_and_normalize(chw, self)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if "shortest_edge" not in self.size:
            return self.size["height"], self.size["width"]
        target = self.size["shortest_edge"]
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(target * long / short)
        return (new_long, target) if width <= height else (target, new_long)


def read_processor_file(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """The JSON object of `path`'s preprocessor_config.json and the file's name (for messages)."""
    f = Path(path) / PROCESSOR_FILE
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(f)!r} cannot be read as JSON ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{str(f)!r} holds no JSON object")
    return d, str(f)


def check_filter_and_statistics(proc: Any, source: str) -> None:
    """A processor's Pillow filter (`resample`) and normalisation statistics, checked."""
    if proc.resample not in range(6):
        raise ConfigError(f"{source}: resample={proc.resample!r} is not a Pillow filter (0..5)")
    for key in ("image_mean", "image_std"):
        value = getattr(proc, key)
        if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, int | float) for v in value):
            raise ConfigError(f"{source}: {key}={value!r} must be three numbers")


def image_array(image: Image.Image, convert_rgb: bool) -> np.ndarray:
    """The image's pixels [H, W, C] (RGB when `convert_rgb`), as the processors read them."""
    pixels = np.asarray(_to_rgb(image) if convert_rgb else image)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def rescale_and_normalize(chw: np.ndarray, proc: Any) -> np.ndarray:
    """The processors' last steps as they compute them: rescale in float64 then float32, normalise in
    float32 (each when the processor says so); [C, H, W] float32 out."""
    if proc.do_rescale:
        chw = (chw.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    if proc.do_normalize:
        x = chw if np.issubdtype(chw.dtype, np.floating) else chw.astype(np.float32)
        mean = np.array(proc.image_mean, dtype=x.dtype)[:, None, None]
        std = np.array(proc.image_std, dtype=x.dtype)[:, None, None]
        chw = (x - mean) / std
    return np.ascontiguousarray(chw, dtype=np.float32)


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resize(pixels_HWC: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    img = Image.fromarray(pixels_HWC[..., 0] if pixels_HWC.shape[-1] == 1 else pixels_HWC.astype(np.uint8))
    out = np.asarray(img.resize((size[1], size[0]), resample=resample))
    return out[..., None] if out.ndim == 2 else out


def _center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """The central height x width window; an image smaller than it is padded with zeros around."""
    _, h, w = chw.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return chw[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((chw.shape[0], new_h, new_w), dtype=chw.dtype)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = chw
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]
