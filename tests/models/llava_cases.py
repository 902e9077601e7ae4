"""Tiny random LLaVA models of transformers (`LlavaForConditionalGeneration`) with awkward shapes, and
their inputs: several images per row, text-only rows, images of several sizes through the
HuggingFace image processor. Shared by the model, checkpoint and serving tests."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from tests.models.hf_families import hf_configs

IMAGE_TOKEN = 95  # the last id of hf_families' 96-token vocabulary

# name -> (vision kind, text family, vision_feature_layer, vision_feature_select_strategy)
CASES = {
    "clip_llama_default": ("clip", "llama", -2, "default"),
    "siglip_qwen2_layers_full": ("siglip", "qwen2", [-1, 0, 2], "full"),
    "clip_qwen3_layers_full": ("clip", "qwen3", [1, -3], "full"),
    "siglip_mistral_default": ("siglip", "mistral", -1, "default"),
    "clip_mixtral_layers_default": ("clip", "mixtral", [-1, -2], "default"),
    "siglip_deepseek_v3_full": ("siglip", "deepseek_v3", -2, "full"),
}


def vision_config(kind: str):
    import transformers as tf

    if kind == "clip":  # 30 // 7 = 4 patches a side, 16 + the class token
        return tf.CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=3,
                                   image_size=30, patch_size=7, projection_dim=16)
    return tf.SiglipVisionConfig(hidden_size=20, intermediate_size=36, num_hidden_layers=3, num_attention_heads=2,
                                 image_size=28, patch_size=5)  # 5 x 5 patches, no class token


def hf_llava(case: str, seed: int = 0, text_config=None, image_token: int = IMAGE_TOKEN):
    """A transformers LLaVA with every weight random (norms near 1), fp32, eval mode; `text_config`
    replaces the case's language model."""
    import transformers as tf

    kind, text, layer, strategy = CASES[case]
    cfg = tf.LlavaConfig(vision_config=vision_config(kind), text_config=text_config or hf_configs()[text],
                         image_token_index=image_token, vision_feature_layer=layer,
                         vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def image_tokens(hf_model) -> int:
    v, strategy = hf_model.config.vision_config, hf_model.config.vision_feature_select_strategy
    tokens = (v.image_size // v.patch_size) ** 2 + (1 if v.model_type == "clip_vision_model" else 0)
    return tokens - (1 if strategy == "default" else 0)


def hf_processor(hf_model):
    """The transformers (Pillow) image processor a tower of this size ships with."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    v = hf_model.config.vision_config
    if v.model_type == "clip_vision_model":
        return CLIPImageProcessorPil(size={"shortest_edge": v.image_size},
                                     crop_size={"height": v.image_size, "width": v.image_size})
    return SiglipImageProcessorPil(size={"height": v.image_size, "width": v.image_size})


def sample_images() -> list[Image.Image]:
    """Images of several sizes, aspect ratios and modes."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (17, 40, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (64, 33, 4), dtype=np.uint8), mode="RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (9, 5), dtype=np.uint8), mode="L")
    return [rgb, rgba, gray]


def prompt_rows(hf_model, seed: int = 3) -> tuple[torch.Tensor, int]:
    """[3, S] ids: row 0 with two images, row 1 text only, row 2 with one image; and the image count."""
    T = image_tokens(hf_model)
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, IMAGE_TOKEN, (n,), generator=g).tolist()

    img = [IMAGE_TOKEN] * T
    rows = [text(3) + img + text(2) + img + text(4), None, text(5) + img]
    S = len(rows[0])
    rows[2] = rows[2] + text(S - len(rows[2]))
    rows[1] = text(S)
    return torch.tensor(rows), 3
