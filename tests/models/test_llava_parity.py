"""LLaVA equals transformers' `LlavaForConditionalGeneration` (fp32 logits within 1e-4, greedy
generation identical) with random weights: CLIP and SigLIP towers, single and multi-layer feature
selection, both strategies, four language-model families, several images per row, a text-only row
in the batch, images of several sizes turned into pixels by the HuggingFace processor."""

import numpy as np
import pytest
import torch

from tessera.checkpoint.hf.llava import load_llava
from tessera.config.errors import ModelError
from tessera.infer.engine.reference_generation import ConcatKVCache
from tests.models.llava_cases import CASES, hf_llava, hf_processor, prompt_rows, sample_images

transformers = pytest.importorskip("transformers")


def _pixels(hf_model) -> torch.Tensor:
    proc = hf_processor(hf_model)
    return torch.from_numpy(np.stack([proc(im, return_tensors="np")["pixel_values"][0] for im in sample_images()]))


def greedy(model, ids: torch.Tensor, pixels: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens of every row: the prompt once (images encoded once), then one position a step."""
    cache, B, S = ConcatKVCache(), ids.shape[0], ids.shape[1]
    logits = model(ids, image_features=model.encode_images(pixels), cache=cache).logits
    out = []
    for step in range(steps):
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        logits = model(nxt[:, None], positions=torch.full((B, 1), S + step), cache=cache).logits
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_generation_match_transformers(case, tmp_path):
    hf = hf_llava(case)
    hf.save_pretrained(tmp_path)
    ids, _ = prompt_rows(hf)
    pixels = _pixels(hf)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels).logits
        generated = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                max_new_tokens=6, do_sample=False)
        want_tokens = generated[:, ids.shape[1]:]
        model = load_llava(tmp_path)
        got = model(ids, pixel_values=pixels).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(greedy(model, ids, pixels, 6), want_tokens)
        # the text-only row is the language model's own answer: the images change only their rows
        text_only = model.language_model(ids[1:2]).logits
        torch.testing.assert_close(got[1:2], text_only, atol=1e-5, rtol=1e-5)


def test_placeholders_must_match_the_images(tmp_path):
    hf = hf_llava("clip_llama_default")
    hf.save_pretrained(tmp_path)
    model = load_llava(tmp_path)
    ids, _ = prompt_rows(hf)
    pixels = _pixels(hf)
    with pytest.raises(ModelError, match="image placeholder tokens"):
        model(ids, pixel_values=pixels[:2])  # three images' placeholders, two images
    with pytest.raises(ModelError, match=r"pixel values \[N, 3, 30, 30\]"):
        model.encode_images(torch.zeros(1, 3, 31, 30))
