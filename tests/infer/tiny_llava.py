"""A tiny LLaVA directory for the serving tests, its images, and transformers' greedy answers."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from tests.infer.tiny_models import VOCAB, hf_config, save_tokenizer
from tests.models.llava_cases import hf_llava, hf_processor, image_tokens

IMAGE = VOCAB - 1  # the char tokenizer's last id stands for "<image>"


def write_llava(path):
    """A tiny LLaVA (CLIP tower, Llama LM) with the char tokenizer written to `path`; the transformers model."""
    hf = hf_llava("clip_llama_default", text_config=hf_config("llama"), image_token=IMAGE)
    hf.save_pretrained(path)
    hf_processor(hf).save_pretrained(path)
    save_tokenizer(path)
    return hf


def images() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((20, 44), (50, 31))]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy(hf, ids: list[int], pics: list[Image.Image], n: int) -> list[int]:
    """transformers' greedy tokens for `ids` whose single image marks are widened as its processor does."""
    T = image_tokens(hf)
    wide = [t for i in ids for t in ([IMAGE] * T if i == IMAGE else [i])]
    x = torch.tensor([wide])
    kwargs = {}
    if pics:
        proc = hf_processor(hf)
        kwargs["pixel_values"] = torch.from_numpy(np.stack([proc(p, return_tensors="np")["pixel_values"][0]
                                                            for p in pics]))
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          **kwargs)
    return out[0, x.shape[1]:].tolist()
