"""Images in the serving engine: placeholders, content keys for the prefix cache, encoder outputs
cached per image.

A prompt marks each image with one `image_token_id`; `expand_placeholders` widens each mark into
the `tokens_per_image` placeholders the model fills with that image's feature rows, so every
image's token count is known before the forward and counts against the step's token budget like
any prompt token. An image is named by a hash of its pixel values (`image_key`): the prefix cache
hashes a block by `Sequence.cache_token_ids`, where each image's placeholders stand as a value
derived from its key (negative, so never a real token id), so two prompts share a block exactly
when their tokens and the images in it are equal, and a repeated image reuses its KV blocks.
`ImageEncoder` keeps the vision seam's outputs (`encode_images`, tessera/models/vision/llava.py) per key,
least recently used out, so a prompt chunked over several steps, or an image seen again, is
encoded once.

Qwen2-VL / Qwen2.5-VL images carry their patch grid (`PromptImage.grid`): each takes its own
number of placeholders, and the tokens of a sequence with such images are rotated by M-RoPE
positions (`mrope_rows`, from the images alone: tessera/models/vision/qwen_vl.py's rule), the paged
step passing them for every token of the sequence, decodes included.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tessera.config.errors import ConfigError


@dataclass(frozen=True)
class PromptImage:
    key: bytes  # content hash of the pixel values (image_key)
    start: int  # prompt position of its first placeholder
    length: int  # its placeholders (= feature rows)
    pixels: np.ndarray  # [C, H, W] float32, what the image processor made (Qwen2-VL: its patch rows)
    grid: tuple[int, int, int] | None = None  # Qwen2-VL: (t, h, w) patches; None: a fixed-size image (LLaVA)

    @property
    def stand_in(self) -> int:
        """The value its placeholders take in the prefix cache's hash: < 0, never a token id."""
        return -1 - int.from_bytes(self.key[:7], "little")


def image_key(pixels: np.ndarray, grid: tuple[int, int, int] | None = None) -> bytes:
    """blake2b over the shape (and patch grid) and the float32 bytes of an image's pixel values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(pixels.shape + (grid or ()), dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.digest()


def expand_placeholders(prompt_ids: list[int], image_token_id: int, tokens_per_image: int | list[int],
                        pixels: list[np.ndarray], grids: list[tuple[int, int, int]] | None = None,
                        ) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt with each `image_token_id` widened to `tokens_per_image` placeholders (one count,
    or one per image), and its images in order. The prompt must mark exactly one place per image."""
    marks = prompt_ids.count(image_token_id)
    if marks != len(pixels):
        raise ConfigError(f"the prompt marks {marks} image place(s) (token id {image_token_id}) but {len(pixels)} "
                          "image(s) came with it; put one image token where each image goes")
    counts = tokens_per_image if isinstance(tokens_per_image, list) else [tokens_per_image] * len(pixels)
    out: list[int] = []
    images = []
    it = iter(zip(pixels, counts, grids or [None] * len(pixels), strict=True))
    for t in prompt_ids:
        if t != image_token_id:
            out.append(t)
            continue
        p, n, grid = next(it)
        images.append(PromptImage(image_key(p, grid), len(out), n, p, grid))
        out.extend([image_token_id] * n)
    return out, tuple(images)


def mrope_rows(images: tuple[PromptImage, ...], start: int, count: int, merge: int) -> torch.Tensor:
    """M-RoPE positions [3, count] of tokens start..start + count of a sequence whose prompt holds
    `images` (with grids, merge x merge patches a token): a text or generated token at j sits at
    j + the sum, over the images before it, of max(rows, columns) - tokens; an image's tokens at
    its first token's position plus their (frame, row, column)."""
    out = torch.arange(start, start + count).expand(3, -1).clone()
    shift = 0
    for im in images:
        H, W = im.grid[1] // merge, im.grid[2] // merge
        a, b = max(im.start, start), min(im.start + im.length, start + count)
        if a < b:
            k = torch.arange(a - im.start, b - im.start)
            out[:, a - start:b - start] = torch.stack([k // (H * W), k // W % H, k % W]) + im.start + shift
        step = max(H, W) - im.length
        shift += step
        after = max(im.start + im.length, start)
        if after < start + count:
            out[:, after - start:] += step
    return out


def cache_ids(token_ids: list[int], images: tuple[PromptImage, ...]) -> list[int]:
    """`token_ids` with each image's placeholders replaced by the image's stand-in value."""
    if not images:
        return token_ids
    out = list(token_ids)
    for im in images:
        out[im.start:im.start + im.length] = [im.stand_in] * im.length
    return out


@dataclass(frozen=True)
class ImageSpan:
    """Rows `first`..`first + count` of `image`'s features go to rows `row`.. of a batch item."""

    row: int
    image: PromptImage
    first: int
    count: int


def spans_in(images: tuple[PromptImage, ...], start: int, length: int) -> list[ImageSpan]:
    """The parts of `images` whose placeholders lie in positions start..start + length."""
    spans = []
    for im in images:
        a, b = max(start, im.start), min(start + length, im.start + im.length)
        if a < b:
            spans.append(ImageSpan(a - start, im, a - im.start, b - a))
    return spans


class ImageEncoder:
    """A vision-language model's `encode_images`, its outputs cached per image key (LRU)."""

    def __init__(self, model, device: torch.device | str, capacity: int = 64):
        self.model, self.device, self.capacity = model, torch.device(device), capacity
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @torch.inference_mode()
    def features(self, images: list[PromptImage]) -> dict[bytes, torch.Tensor]:
        """[length, D] feature rows of each image, by key; the uncached ones encoded in one batch."""
        out: dict[bytes, torch.Tensor] = {}
        todo: dict[bytes, PromptImage] = {}
        for im in images:
            if im.key in self.cache:
                self.cache.move_to_end(im.key)
                out[im.key] = self.cache[im.key]
                self.hits += 1
            elif im.key not in todo:
                todo[im.key] = im
                self.misses += 1
        if todo:
            ims = list(todo.values())
            if ims[0].grid is not None:  # patch rows of any count, with their grids
                pixels = torch.from_numpy(np.concatenate([im.pixels for im in ims])).to(self.device)
                encoded = self.model.encode_images(pixels, torch.tensor([im.grid for im in ims]))
            else:
                pixels = torch.from_numpy(np.stack([im.pixels for im in ims])).to(self.device)
                encoded = self.model.encode_images(pixels)
            for key, rows in zip(todo, encoded, strict=True):
                out[key] = self.cache[key] = rows
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        return out
