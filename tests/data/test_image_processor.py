"""Pixel values equal to HuggingFace's CLIP and SigLIP image processors (the Pillow ones) for the
same image, bit for bit; and images decoded as untrusted input, each bad one refused by name."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tessera.config.errors import ConfigError, ImageError
from tessera.data.image_processor import ImageProcessor, decode_image

pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil  # noqa: E402


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    rgb = Image.fromarray(rng.integers(0, 256, (17, 40, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (61, 23, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (33, 33, 4), dtype=np.uint8), mode="RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (9, 5), dtype=np.uint8), mode="L")
    palette = rgb.convert("P")
    palette.info["transparency"] = 3
    tiny = Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8))
    return [rgb, tall, rgba, gray, palette, tiny]


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format=fmt)
    return buf.getvalue()


PROCESSORS = {
    "clip": lambda: CLIPImageProcessorPil(size={"shortest_edge": 30},
                                                       crop_size={"height": 30, "width": 30}),
    "clip_crop_pads": lambda: CLIPImageProcessorPil(size={"shortest_edge": 12},
                                                                 crop_size={"height": 15, "width": 19}),
    "clip_defaults": lambda: CLIPImageProcessorPil(),
    "siglip": lambda: SiglipImageProcessorPil(size={"height": 28, "width": 28}),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixel_values_equal_the_huggingface_processor(name):
    hf = PROCESSORS[name]()
    mine = ImageProcessor.from_dict(hf.to_dict())
    images = _images() + [decode_image(_encoded(im, fmt)) for im in _images()[:2] for fmt in ("PNG", "JPEG")]
    for image in images:
        want = hf(image, return_tensors="np")["pixel_values"][0]
        got = mine(image)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_output_size_is_known_before_any_image():
    assert ImageProcessor.from_dict(PROCESSORS["clip_crop_pads"]().to_dict()).output_size() == (15, 19)
    assert ImageProcessor.from_dict(PROCESSORS["siglip"]().to_dict()).output_size() == (28, 28)


def test_a_bad_processor_config_is_refused_by_name():
    with pytest.raises(ConfigError, match="image_processor_type='ViTImageProcessor' is not supported"):
        ImageProcessor.from_dict({"image_processor_type": "ViTImageProcessor"})
    with pytest.raises(ConfigError, match="size"):
        ImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": -3}})


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A small PNG file claiming width x height: its header, and a few compressed bytes of pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def test_bad_images_are_refused_by_name():
    good = _encoded(_images()[0], "PNG")
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"hello, world: plainly not an image" + b"\0" * 40)
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"")
    with pytest.raises(ImageError, match="truncated"):
        decode_image(good[: len(good) // 2])
    with pytest.raises(ImageError, match="truncated"):
        decode_image(_encoded(_images()[1], "JPEG")[:300])
    with pytest.raises(ImageError, match="decompression bomb"):  # Pillow's own limit, from the header alone
        decode_image(_png_header(200_000, 200_000))
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode_image(good, max_pixels=100)
    with pytest.raises(ImageError, match="zero width or height"):
        decode_image(_png_header(0, 7))
    assert decode_image(good).size == (40, 17)
