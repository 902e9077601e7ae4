"""Image-text conversations for supervised fine-tuning of a vision-language model (LLaVA, Qwen2-VL,
Qwen2.5-VL).

Each JSONL record is one conversation, in one of two formats:

- OpenAI's chat format: `{"messages": [{"role": ..., "content": ...}, ...]}` where a content is a
  string or a list of parts: `{"type": "text", "text": ...}`, `{"type": "image", "image": SRC}`
  (also spelled `"path"` or `"url"`) and `{"type": "image_url", "image_url": {"url": SRC}}`;
- LLaVA's: `{"image": SRC, "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": ...}]}` (`"images": [SRC, ...]` for several; `from` is human, gpt or
  system), each `<image>` in a value marking where an image goes, in order.

An image SRC is a path relative to the JSONL file (or absolute), a `file://` url, or a `data:`
url (base64). http(s) is refused: training never downloads. Images are decoded by Pillow as
untrusted input and turned into pixel values by the model's image processor
(tessera/data/image_processor.py; Qwen's: tessera/data/qwen_image_processor.py).

A conversation is rendered with the tokenizer's chat template (or `PLAIN_CHAT_TEMPLATE`) with the
text `<image>` where each image goes; the text between images is tokenized piece by piece and
each image becomes its tokens, exactly as the server tokenizes a chat request
(tessera/infer/api/server.py, `encode_around`, then the engine's placeholders), so a model is trained
on the token sequences it is served: for LLaVA (`load_vision_sft`) `tokens_per_image` copies of
the image token; for Qwen2-VL / Qwen2.5-VL (`load_qwen_vision_sft`) the vision start token, the
image's own number of image tokens (its patch grid from Qwen's processor, t x h x w / merge^2) and
the vision end token, what Qwen's chat template and processor write for an image part
(`llava_samples` / `qwen_vl_samples` read those tokens from the model's config: what each family's
entry in tessera/checkpoint/vision_families.py names). The loss
mask is 1 on the assistant answers only (tessera.data.sft: the same spans), never on image
tokens. One conversation is one sample of `seq_len + 1` tokens, padded with token 0 (masked); a
longer one is refused with a DataError naming it (an image must never be cut).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tessera.config.errors import DataError, ImageError
from tessera.data.documents import expand_inputs, iter_jsonl
from tessera.data.image_processor import ImageProcessor, decode_image
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.data.sft import ANSWER_ROLE, render_with_answer_spans
from tessera.data.tokenizer import Tokenizer

IMAGE_MARK = "<image>"  # where an image goes in a rendered conversation (LLaVA's own spelling)
LLAVA_ROLES = {"human": "user", "gpt": ANSWER_ROLE, "system": "system"}


class VisionSample(NamedTuple):
    """A `Sample` (tessera.data.sampling) with its images: float32 `pixels`, LLaVA's [N, C, H, W] (N
    may be 0) or Qwen's patch rows [P, C x T x p^2] of all its images, with their int64 `grids`
    [N, 3] (None for LLaVA)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    pixels: np.ndarray
    grids: np.ndarray | None = None


def read_image_source(src: Any, base: Path, where: str) -> bytes:
    """The encoded bytes of image `src` (module docstring: where an image may come from)."""
    if not isinstance(src, str) or not src:
        raise DataError(f"{where}: an image must be a path or a data: url, got {src!r:.60}")
    scheme = src.split(":", 1)[0].lower() if ":" in src else ""
    if scheme == "data":
        head, sep, payload = src.partition(",")
        if not sep or not head.endswith(";base64"):
            raise DataError(f"{where}: a data: image url must be 'data:<type>;base64,<data>'")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: the data: image url holds invalid base64") from None
    if scheme in ("http", "https"):
        raise DataError(f"{where}: image {src[:60]!r} is a web address; training reads images from files or data: "
                        "urls only (download them first)")
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(src).path)) if scheme == "file" else Path(src)
    path = path if path.is_absolute() else base / path
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"{where}: image {str(path)!r} cannot be read ({type(e).__name__})") from None


def _part_text(part: Any, images: list[Any], where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image":
        src = next((part[k] for k in ("image", "path", "url") if k in part), None)
        images.append(src)
        return IMAGE_MARK
    if kind == "image_url":
        value = part.get("image_url")
        images.append(value.get("url") if isinstance(value, dict) else value)
        return IMAGE_MARK
    raise DataError(f"{where}: content parts are {{'type': 'text', 'text': ...}}, {{'type': 'image', 'image': ...}} "
                    f"or {{'type': 'image_url', 'image_url': {{'url': ...}}}}; got {part!r:.80}")


def vision_conversation(record: dict[str, Any], where: str) -> tuple[list[dict[str, str]], list[Any]]:
    """The messages of one record (each image as `IMAGE_MARK` in its text) and its image sources."""
    images: list[Any] = []
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
        images = list(record["images"]) if isinstance(record.get("images"), list) else (
            [record["image"]] if "image" in record else [])
        messages = []
        for n, turn in enumerate(turns):
            if (not isinstance(turn, dict) or turn.get("from") not in LLAVA_ROLES
                    or not isinstance(turn.get("value"), str)):
                raise DataError(f"{where}: conversations[{n}] must be {{'from': one of {', '.join(LLAVA_ROLES)}, "
                                f"'value': text}}, got {turn!r:.80}")
            messages.append({"role": LLAVA_ROLES[turn["from"]], "content": turn["value"]})
    elif "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        messages = []
        for n, m in enumerate(raw):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(_part_text(p, images, f"{where}: messages[{n}]") for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise DataError(f"{where}: messages[{n}] must have a string 'role' and a 'content' that is text or "
                                f"a list of parts, got {m!r:.80}")
            messages.append({"role": m["role"], "content": content})
    else:
        raise DataError(f"{where}: expected 'messages' (OpenAI's chat format) or 'conversations' (LLaVA's); fields "
                        f"present: {', '.join(sorted(record)) or 'none'}")
    if not any(m["role"] == ANSWER_ROLE for m in messages):
        raise DataError(f"{where}: no {ANSWER_ROLE!r} (gpt) turn, so nothing to train on")
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages)
    if marks != len(images):
        raise DataError(f"{where}: the conversation marks {marks} image place(s) ({IMAGE_MARK!r} or image parts) but "
                        f"names {len(images)} image(s); each image needs exactly one place")
    return messages, images


def tokenize_with_images(tokenizer: Tokenizer, messages: list[dict[str, str]], images: list[list[int]],
                         reserved: set[int], chat_template: str | None = None,
                         where: str = "record") -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, the k-th `IMAGE_MARK` replaced by `images[k]` (that
    image's tokens), and the 0/1 answer mask (module docstring). Text that tokenizes to a `reserved`
    id (the image tokens) is refused: an image's place must come from an image only."""
    text, spans = render_with_answer_spans(tokenizer, messages, chat_template, where)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for k, piece in enumerate(text.split(IMAGE_MARK)):
        if k:
            ids += images[k - 1]
            mask += [0] * len(images[k - 1])
            pos += len(IMAGE_MARK)
        if piece:
            piece_ids, offsets = tokenizer.encode_with_offsets(piece, add_special_tokens=False)
            clash = reserved.intersection(piece_ids)
            if clash:
                raise DataError(f"{where}: the text tokenizes to the image token id(s) {sorted(clash)}; the image "
                                "tokens must be ones no text gives (train.vision_language.image_token_id, and "
                                "vision_start_token_id / vision_end_token_id for Qwen2-VL)")
            ids += piece_ids
            mask += [int(any(pos + s < b and pos + e > a for a, b in spans)) for s, e in offsets]
        pos += len(piece)
    return ids, mask


# (the images' decoded sources, where) -> (pixels, grids or None, each image's tokens)
ImageEncoder = Callable[[list[Any], str], tuple[np.ndarray, np.ndarray | None, list[list[int]]]]


def _load(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, encode: ImageEncoder, reserved: set[int],
          seq_len: int, chat_template: str | None) -> list[VisionSample]:
    """Every conversation of the JSONL `inputs` as a sample, its images made by `encode`."""
    samples = []
    for path in expand_inputs(inputs, suffixes=(".jsonl",)):
        for number, record, _ in iter_jsonl(path):
            where = f"{path}:{number}"
            messages, sources = vision_conversation(record, where)
            images = []
            for k, src in enumerate(sources):
                try:
                    images.append(decode_image(read_image_source(src, path.parent, where)))
                except ImageError as e:
                    raise DataError(f"{where}: image {k + 1}: {e}") from None
            try:
                pixels, grids, image_ids = encode(images, where)
            except ImageError as e:
                raise DataError(f"{where}: {e}") from None
            ids, mask = tokenize_with_images(tokenizer, messages, image_ids, reserved, chat_template, where)
            if len(ids) > seq_len + 1:
                raise DataError(f"{where}: the conversation takes {len(ids)} tokens with its {len(sources)} image(s) "
                                f"({sum(map(len, image_ids))} image tokens), more than train.seq_len + 1 = "
                                f"{seq_len + 1}; raise train.seq_len or shorten the conversation (an image is never "
                                "cut)")
            pad = seq_len + 1 - len(ids)
            samples.append(VisionSample(np.array(ids + [0] * pad, dtype=np.int64),
                                        np.array(mask + [0] * pad, dtype=bool), pixels, grids))
    return samples


def load_vision_sft(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, processor: ImageProcessor,
                    image_token_id: int, tokens_per_image: int, seq_len: int,
                    chat_template: str | None = None) -> list[VisionSample]:
    """LLaVA: every conversation of the JSONL `inputs` as a sample of `seq_len + 1` tokens with its
    mask and its images' pixel values [N, C, H, W] (N = 0 for a text-only conversation)."""
    shape = (3, *processor.output_size())

    def encode(images: list[Any], where: str) -> tuple[np.ndarray, None, list[list[int]]]:
        pixels = np.zeros((len(images), *shape), dtype=np.float32)
        for k, image in enumerate(images):
            try:
                pixels[k] = processor(image)
            except ImageError as e:
                raise ImageError(f"image {k + 1}: {e}") from None
        return pixels, None, [[image_token_id] * tokens_per_image for _ in images]

    return _load(inputs, tokenizer, encode, {image_token_id}, seq_len, chat_template)


def load_qwen_vision_sft(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, processor: QwenImageProcessor,
                         image_token_id: int, vision_start_token_id: int, vision_end_token_id: int, seq_len: int,
                         chat_template: str | None = None) -> list[VisionSample]:
    """Qwen2-VL / Qwen2.5-VL: every conversation of the JSONL `inputs` as a sample of `seq_len + 1`
    tokens with its mask, its images' patch rows [P, C x T x p^2] (all its images, in order) and
    their grids [N, 3]; each image is vision start, its t x h x w / merge^2 image tokens, vision end."""
    rows = 3 * processor.temporal_patch_size * processor.patch_size**2

    def encode(images: list[Any], where: str) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
        pixels, grids = [], []
        for k, image in enumerate(images):
            try:
                p, grid = processor(image)
            except ImageError as e:
                raise ImageError(f"image {k + 1}: {e}") from None
            pixels.append(p)
            grids.append(grid)
        ids = [[vision_start_token_id] + [image_token_id] * (t * h * w // processor.merge_size**2)
               + [vision_end_token_id] for t, h, w in grids]
        values = np.concatenate(pixels) if pixels else np.zeros((0, rows), dtype=np.float32)
        return values, np.array(grids, dtype=np.int64).reshape(-1, 3), ids

    reserved = {image_token_id, vision_start_token_id, vision_end_token_id}
    return _load(inputs, tokenizer, encode, reserved, seq_len, chat_template)


def llava_samples(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, processor: ImageProcessor, cfg: Any,
                  seq_len: int) -> list[VisionSample]:
    """`load_vision_sft` with LLaVA config `cfg`'s image token, `image_tokens` of it per image."""
    return load_vision_sft(inputs, tokenizer, processor, cfg.image_token_id, cfg.image_tokens, seq_len)


def qwen_vl_samples(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, processor: QwenImageProcessor,
                    cfg: Any, seq_len: int) -> list[VisionSample]:
    """`load_qwen_vision_sft` with Qwen2-VL / Qwen2.5-VL config `cfg`'s image, vision start and end tokens."""
    return load_qwen_vision_sft(inputs, tokenizer, processor, cfg.image_token_id, cfg.vision_start_token_id,
                                cfg.vision_end_token_id, seq_len)


class VisionSFTDataset:
    """Samples in memory (a `SampleDataset`): the conversations are few enough to hold, images included."""

    def __init__(self, samples: list[VisionSample], seq_len: int):
        self.samples, self.seq_len = samples, seq_len

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> VisionSample:
        return self.samples[index]


def split_samples(samples: list[VisionSample], valid_fraction: float) -> tuple[list[VisionSample], list[VisionSample]]:
    """(training, validation): the last `valid_fraction` of the conversations (rounded half up, at
    least one when positive) are held out, as tessera.data.sampling splits packed samples."""
    n_valid = 0 if valid_fraction <= 0 else max(1, math.floor(len(samples) * valid_fraction + 0.5))
    if n_valid >= len(samples):
        raise DataError(f"data.valid_fraction={valid_fraction} holds out all {len(samples)} conversation(s); "
                        "lower it or add conversations")
    return samples[:len(samples) - n_valid], samples[len(samples) - n_valid:]
