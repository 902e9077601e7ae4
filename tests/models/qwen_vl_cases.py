"""Tiny random Qwen2-VL / Qwen2.5-VL models of transformers with awkward shapes, their image processor
and inputs: images of several sizes and aspect ratios (one shrunk to max_pixels, one grown to
min_pixels), several per row, a text-only row. Shared by the model, processor and checkpoint tests."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

IMAGE, VISION_START, VISION_END, VIDEO = 95, 93, 94, 92  # the last ids of a 96-token vocabulary
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64

# head_dim 10: five rotary pairs split (t, h, w) = (1, 2, 2); vision head sizes 12 and 8
TEXT = dict(vocab_size=96, hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [1, 2, 2]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=24, hidden_size=40, num_heads=2, mlp_ratio=2, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, hidden_act="quick_gelu"),
    # windows of 16 pixels = 2 x 2 merged tokens; block 1 attends over the whole image
    "qwen2_5_vl": dict(depth=3, hidden_size=16, intermediate_size=20, num_heads=2, out_hidden_size=40, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1],
                       hidden_act="silu"),
}
VERSIONS = sorted(VISION)


def hf_qwen_vl(version: str, seed: int = 0, tie: bool = False, vocab: int = 96):
    """A transformers Qwen2-VL / Qwen2.5-VL with every weight random (norms near 1), fp32, eval mode;
    its image, vision start / end and video tokens the last four ids of its `vocab`."""
    import transformers as tf

    cls, model_cls = ((tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration) if version == "qwen2_vl"
                      else (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration))
    shift = vocab - 96
    cfg = cls(text_config={**TEXT, "vocab_size": vocab, "tie_word_embeddings": tie, "bos_token_id": None,
                           "eos_token_id": None},
              vision_config=VISION[version], image_token_id=IMAGE + shift, vision_start_token_id=VISION_START + shift,
              vision_end_token_id=VISION_END + shift, video_token_id=VIDEO + shift, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if ("norm" in name or "ln_q" in name) and "weight" in name else 0.08 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def sample_images() -> list[Image.Image]:
    """Wide, tall, large (shrunk to max_pixels) and tiny grey (grown to min_pixels) images."""
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (17, 40, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (64, 33, 4), dtype=np.uint8), mode="RGBA")
    tiny = Image.fromarray(rng.integers(0, 256, (9, 5), dtype=np.uint8), mode="L")
    large = Image.fromarray(rng.integers(0, 256, (70, 120, 3), dtype=np.uint8))
    return [wide, tall, large, tiny]


def hf_inputs(images: list[Image.Image] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' pixel_values and image_grid_thw of the images."""
    out = hf_processor()(images or sample_images(), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt_rows(grid_thw: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """[3, S] ids: row 0 with images 0, 1 and 2, row 1 text only, row 2 with image 3; each image's
    placeholders between vision start / end tokens, as the chat template writes them."""
    g = torch.Generator().manual_seed(seed)
    counts = [int(t * h * w) // 4 for t, h, w in grid_thw.tolist()]

    def text(n):
        return torch.randint(0, VIDEO, (n,), generator=g).tolist()

    def img(i):
        return [VISION_START] + [IMAGE] * counts[i] + [VISION_END]

    rows = [text(3) + img(0) + text(2) + img(1) + img(2) + text(4), None, text(5) + img(3)]
    S = len(rows[0])
    rows[2] = rows[2] + text(S - len(rows[2]))
    rows[1] = text(S)
    return torch.tensor(rows)


def mm_token_types(ids: torch.Tensor) -> torch.Tensor:
    """transformers' mm_token_type_ids: 1 at image placeholders, 0 elsewhere."""
    return (ids == IMAGE).int()
