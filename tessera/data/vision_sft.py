"""Image-text conversations for supervised fine-tuning of a vision-language model (LLaVA).

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
(tessera/data/image_processor.py).

A conversation is rendered with the tokenizer's chat template (or `PLAIN_CHAT_TEMPLATE`) with the
text `<image>` where each image goes; the text between images is tokenized piece by piece and
each image becomes `tokens_per_image` copies of the model's image token, exactly as the server
tokenizes a chat request (tessera/infer/server.py, `encode_around`), so a model is trained on the
token sequences it is served. The loss mask is 1 on the assistant answers only (tessera.data.sft:
the same spans), never on image placeholders. One conversation is one sample of `seq_len + 1`
tokens, padded with token 0 (masked); a longer one is refused with a DataError naming it (an image
must never be cut).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tessera.config.errors import DataError, ImageError
from tessera.data.documents import expand_inputs, iter_jsonl
from tessera.data.image_processor import ImageProcessor, decode_image
from tessera.data.sft import ANSWER_ROLE, render_with_answer_spans
from tessera.data.tokenizer import Tokenizer

IMAGE_MARK = "<image>"  # where an image goes in a rendered conversation (LLaVA's own spelling)
LLAVA_ROLES = {"human": "user", "gpt": ANSWER_ROLE, "system": "system"}


class VisionSample(NamedTuple):
    """A `Sample` (tessera.data.sampling) with its images: float32 `pixels` [N, C, H, W] (N may be 0)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    pixels: np.ndarray


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


def tokenize_with_images(tokenizer: Tokenizer, messages: list[dict[str, str]], image_token_id: int,
                         tokens_per_image: int, chat_template: str | None = None,
                         where: str = "record") -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, each `IMAGE_MARK` widened to `tokens_per_image`
    image tokens, and the 0/1 answer mask (module docstring)."""
    text, spans = render_with_answer_spans(tokenizer, messages, chat_template, where)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for k, piece in enumerate(text.split(IMAGE_MARK)):
        if k:
            ids += [image_token_id] * tokens_per_image
            mask += [0] * tokens_per_image
            pos += len(IMAGE_MARK)
        if piece:
            piece_ids, offsets = tokenizer.encode_with_offsets(piece, add_special_tokens=False)
            if image_token_id in piece_ids:
                raise DataError(f"{where}: the text tokenizes to the image token id {image_token_id}; the image "
                                "token must be one no text gives (train.vision_language.image_token_id)")
            ids += piece_ids
            mask += [int(any(pos + s < b and pos + e > a for a, b in spans)) for s, e in offsets]
        pos += len(piece)
    return ids, mask


def load_vision_sft(inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, processor: ImageProcessor,
                    image_token_id: int, tokens_per_image: int, seq_len: int,
                    chat_template: str | None = None) -> list[VisionSample]:
    """Every conversation of the JSONL `inputs` as a sample of `seq_len + 1` tokens with its mask and
    its images' pixel values [N, C, H, W] (N = 0 for a text-only conversation)."""
    shape = (3, *processor.output_size())
    samples = []
    for path in expand_inputs(inputs, suffixes=(".jsonl",)):
        for number, record, _ in iter_jsonl(path):
            where = f"{path}:{number}"
            messages, sources = vision_conversation(record, where)
            ids, mask = tokenize_with_images(tokenizer, messages, image_token_id, tokens_per_image, chat_template,
                                             where)
            if len(ids) > seq_len + 1:
                raise DataError(f"{where}: the conversation takes {len(ids)} tokens with its {len(sources)} image(s) "
                                f"({tokens_per_image} tokens each), more than train.seq_len + 1 = {seq_len + 1}; "
                                "raise train.seq_len or shorten the conversation (an image is never cut)")
            pixels = np.zeros((len(sources), *shape), dtype=np.float32)
            for k, src in enumerate(sources):
                try:
                    pixels[k] = processor(decode_image(read_image_source(src, path.parent, where)))
                except ImageError as e:
                    raise DataError(f"{where}: image {k + 1}: {e}") from None
            pad = seq_len + 1 - len(ids)
            samples.append(VisionSample(np.array(ids + [0] * pad, dtype=np.int64),
                                  np.array(mask + [0] * pad, dtype=bool), pixels))
    if not samples:
        raise DataError(f"no conversations found in {', '.join(str(p) for p in inputs)}")
    return samples


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
