"""Qwen2-VL's image preprocessing equals transformers' `Qwen2VLImageProcessorPil` for the same Pillow
image, bit for bit: smart_resize within min/max pixels, normalisation, the block-major patch rows
(`pixel_values`) and `image_grid_thw`; the placeholder count is known from the image size alone."""

import json

import numpy as np
import pytest
from PIL import Image

from tessera.config.errors import ConfigError, ImageError
from tessera.config.qwen_vl import QwenVisionConfig
from tessera.data.qwen_image_processor import QwenImageProcessor, smart_resize

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize  # noqa: E402


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    rgb = Image.fromarray(rng.integers(0, 256, (17, 40, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (161, 23, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (33, 33, 4), dtype=np.uint8), mode="RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (9, 5), dtype=np.uint8), mode="L")
    palette = rgb.convert("P")
    palette.info["transparency"] = 3
    big = Image.fromarray(rng.integers(0, 256, (300, 220, 3), dtype=np.uint8))
    return [rgb, tall, rgba, gray, palette, big]


CONFIGS = {  # (patch, temporal, merge, min_pixels, max_pixels)
    "tiny_patches": (4, 2, 2, 16 * 16, 64 * 64),
    "qwen_default_patches": (14, 2, 2, 56 * 56, 28 * 28 * 40),
    "odd": (5, 3, 3, 30 * 30, 90 * 90),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pixel_values_and_grids_equal_transformers(name, tmp_path):
    patch, temporal, merge, lo, hi = CONFIGS[name]
    hf = Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                  size={"shortest_edge": lo, "longest_edge": hi})
    hf.save_pretrained(tmp_path)
    mine = QwenImageProcessor.from_directory(tmp_path)  # read from transformers' own file
    assert (mine.patch_size, mine.temporal_patch_size, mine.merge_size, mine.min_pixels, mine.max_pixels) == \
        (patch, temporal, merge, lo, hi)
    want = hf(_images(), return_tensors="np")
    values, grids = mine.batch(_images())
    assert np.array_equal(grids, want["image_grid_thw"])
    assert values.dtype == np.float32 and np.array_equal(values, want["pixel_values"])
    for image, (t, h, w) in zip(_images(), grids.tolist(), strict=True):
        assert mine.image_tokens(image.height, image.width) == t * h * w // merge**2  # before any pixel work
        assert mine.grid(image.height, image.width) == (t, h, w)


def test_smart_resize_equals_transformers_over_many_sizes():
    for height in (1, 3, 27, 28, 29, 100, 999, 4000):
        for width in (2, 28, 57, 500, 3001):
            if max(height, width) / min(height, width) > 200:
                with pytest.raises(ImageError, match="aspect ratio"):
                    smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)
                continue
            assert smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280) == \
                hf_smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)


def test_written_config_is_read_back_by_transformers(tmp_path):
    mine = QwenImageProcessor.for_vision(QwenVisionConfig(patch_size=4, temporal_patch_size=2, spatial_merge_size=2))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(mine.to_dict()))
    hf = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    want = hf(_images()[:2], return_tensors="np")
    values, grids = mine.batch(_images()[:2])
    assert np.array_equal(values, want["pixel_values"]) and np.array_equal(grids, want["image_grid_thw"])


def test_older_min_max_pixel_keys_and_bad_configs(tmp_path):
    old = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 100, "max_pixels": 5000,
           "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}
    proc = QwenImageProcessor.from_dict(old)
    assert (proc.min_pixels, proc.max_pixels) == (100, 5000)
    with pytest.raises(ConfigError, match="CLIPImageProcessor.*not supported for Qwen2-VL"):
        QwenImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ConfigError, match="min <= max"):
        QwenImageProcessor.from_dict({**old, "min_pixels": 6000})
    with pytest.raises(ConfigError, match="vision tower takes"):
        proc.check_tower(QwenVisionConfig(patch_size=14), "x")
