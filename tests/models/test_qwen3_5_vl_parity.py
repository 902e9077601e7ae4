"""Qwen3.5 and Qwen3.5-MoE with images equal transformers' `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` (fp32 logits within 1e-4, greedy generation identical) with
random weights: Qwen3-VL's tower (a biased patch embedding, the learned position table resampled
to images of several sizes and aspect ratios, three in one row), interleaved M-RoPE over the
hybrid language model (Gated DeltaNet and gated attention), a text-only row beside and text-only
prompts alone."""

import pytest
import torch

from tessera.checkpoint.hf.qwen3_5_vl import load_qwen3_5_vl, qwen3_5_vl_names
from tessera.config.qwen3_5_vl import qwen3_5_vl_config_from_hf
from tessera.models.vision.qwen3_vision import Qwen35VL
from tests.models.qwen3_5_vl_cases import FAMILIES, hf_qwen3_5_vl
from tests.models.qwen_vl_cases import hf_inputs, mm_token_types, prompt_rows
from tests.models.test_qwen_vl_parity import greedy

transformers = pytest.importorskip("transformers")


def _hf_logits(hf, ids, pixels=None, grids=None):
    with torch.no_grad():
        if pixels is None:
            return hf(input_ids=ids).logits
        return hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  mm_token_type_ids=mm_token_types(ids)).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_generation_match_transformers(family, tmp_path):
    hf = hf_qwen3_5_vl(family)
    hf.save_pretrained(tmp_path)
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    want = _hf_logits(hf, ids, pixels, grids)
    with torch.no_grad():
        kwargs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm_token_types(ids))
        want_tokens = hf.generate(**kwargs, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  do_sample=False)[:, ids.shape[1]:]
        want_positions, _ = hf.model.get_rope_index(ids, mm_token_types(ids), image_grid_thw=grids)
        model = load_qwen3_5_vl(tmp_path)
        assert type(model) is Qwen35VL and model.cfg.mrope_interleaved
        assert torch.equal(model.rope_positions(ids, grids), want_positions)
        got = model(ids, pixel_values=pixels, image_grid_thw=grids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(greedy(model, ids, pixels, grids, 6), want_tokens)
        # text-only prompts: transformers' answer without images, and the language model's own
        text = ids[1:2]
        torch.testing.assert_close(model(text).logits, _hf_logits(hf, text), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1:2], model.language_model(text).logits, atol=1e-5, rtol=1e-5)
        want_text = hf.generate(input_ids=text, attention_mask=torch.ones_like(text), max_new_tokens=6,
                                do_sample=False)[:, text.shape[1]:]
        assert torch.equal(greedy(model, text, pixels[:0], grids[:0], 6), want_text)


def test_vision_tower_matches_transformers_alone():
    """The tower's merged features, image by image, equal transformers' `get_image_features`:
    the learned positions resampled to 4 grids of other sizes than the 4 x 4 table."""
    hf = hf_qwen3_5_vl("qwen3_5", seed=1)
    pixels, grids = hf_inputs()
    model = Qwen35VL(qwen3_5_vl_config_from_hf(hf.config.to_dict()), init_seed=None).eval()
    theirs = hf.state_dict()
    with torch.no_grad():
        for key, (h,) in qwen3_5_vl_names(model.cfg).items():
            model.get_parameter(key).copy_(theirs[h])
        want = hf.model.get_image_features(pixels, grids).pooler_output
        got = model.encode_images(pixels, grids)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_interleaved_and_consecutive_mrope_differ(tmp_path):
    """The interleaved M-RoPE is what makes the image rows equal: with Qwen2-VL's consecutive
    groups instead, the logits at and after the images move (the seam is not a no-op here)."""
    hf = hf_qwen3_5_vl("qwen3_5", seed=2)
    hf.save_pretrained(tmp_path)
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    model = load_qwen3_5_vl(tmp_path)
    with torch.no_grad():
        right = model(ids, pixel_values=pixels, image_grid_thw=grids).logits
        model.language_model.mrope_interleaved = False
        wrong = model(ids, pixel_values=pixels, image_grid_thw=grids).logits
    torch.testing.assert_close(right, _hf_logits(hf, ids, pixels, grids), atol=1e-4, rtol=1e-4)
    assert (wrong[0] - right[0]).abs().max() > 1e-3
    torch.testing.assert_close(wrong[1], right[1])  # the text-only row: every coordinate equal
