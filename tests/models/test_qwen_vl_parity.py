"""Qwen2-VL and Qwen2.5-VL equal transformers' `Qwen2VLForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` (fp32 logits within 1e-4, greedy generation identical) with
random weights and awkward shapes: the native-resolution tower (2-D rotary positions, Qwen2.5-VL's
windows and full-attention block, the 2x2 merger), M-RoPE positions from the image grids, images
of several sizes and aspect ratios, three in one row, a text-only row in the batch."""

import pytest
import torch

from tessera.checkpoint.hf.qwen_vl import load_qwen_vl
from tessera.config.errors import ModelError
from tessera.infer.engine.reference_generation import ConcatKVCache
from tessera.models.vision.qwen_vl import mrope_positions
from tests.models.qwen_vl_cases import IMAGE, VERSIONS, hf_inputs, hf_qwen_vl, mm_token_types, prompt_rows

transformers = pytest.importorskip("transformers")


def greedy(model, ids: torch.Tensor, pixels: torch.Tensor, grids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens of every row: the prompt once, then one position a step, each row continuing
    from its largest M-RoPE position + 1."""
    cache, S = ConcatKVCache(), ids.shape[1]
    positions, deltas = mrope_positions(ids, IMAGE, [tuple(g) for g in grids.tolist()], 2)
    features = model.encode_images(pixels, grids)
    logits = model(ids, image_features=features, image_grid_thw=grids, positions=positions, cache=cache).logits
    out = []
    for step in range(steps):
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        logits = model(nxt[:, None], positions=(S + step + deltas)[:, None], cache=cache).logits
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("version", VERSIONS)
def test_logits_and_greedy_generation_match_transformers(version, tmp_path):
    hf = hf_qwen_vl(version)
    hf.save_pretrained(tmp_path)
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    with torch.no_grad():
        kwargs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm_token_types(ids))
        want = hf(**kwargs).logits
        generated = hf.generate(**kwargs, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        want_tokens = generated[:, ids.shape[1]:]
        want_positions, _ = hf.model.get_rope_index(ids, mm_token_types(ids), image_grid_thw=grids)
        model = load_qwen_vl(tmp_path)
        assert torch.equal(model.rope_positions(ids, grids), want_positions)
        got = model(ids, pixel_values=pixels, image_grid_thw=grids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(greedy(model, ids, pixels, grids, 6), want_tokens)
        # the text-only row is the language model's own answer at positions 0..S-1
        torch.testing.assert_close(got[1:2], model.language_model(ids[1:2]).logits, atol=1e-5, rtol=1e-5)
        features = model.encode_images(pixels, grids)
        assert [f.shape[0] for f in features] == [int(g.prod()) // 4 for g in grids]


def test_vision_tower_matches_transformers_alone():
    """The tower's merged features, image by image, equal transformers' `get_image_features`."""
    hf = hf_qwen_vl("qwen2_5_vl", seed=1)
    pixels, grids = hf_inputs()
    from tessera.checkpoint.hf.qwen_vl import qwen_vl_names
    from tessera.config.qwen_vl import qwen_vl_config_from_hf
    from tessera.models.vision.qwen_vl import QwenVL

    model = QwenVL(qwen_vl_config_from_hf(hf.config.to_dict()), init_seed=None).eval()
    theirs = hf.state_dict()
    with torch.no_grad():
        for key, h in qwen_vl_names(model.cfg).items():
            model.get_parameter(key).copy_(theirs[h])
        want = hf.model.get_image_features(pixels, grids).pooler_output
        got = model.encode_images(pixels, grids)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_placeholders_and_grids_must_agree(tmp_path):
    hf = hf_qwen_vl("qwen2_vl")
    hf.save_pretrained(tmp_path)
    model = load_qwen_vl(tmp_path)
    pixels, grids = hf_inputs()
    ids = prompt_rows(grids)
    with pytest.raises(ModelError, match="image_grid_thw"):
        model(ids, pixel_values=pixels)
    with pytest.raises(ModelError, match="patch rows"):
        model(ids, pixel_values=pixels[:-1], image_grid_thw=grids)
    with pytest.raises(ModelError, match=r"pixel_values must be \[patches, 96\]"):
        model.encode_images(pixels[:, :90], grids)
    with pytest.raises(ModelError, match="multiples of spatial_merge_size=2"):
        model.encode_images(pixels[:12], torch.tensor([[1, 3, 4]]))
    with pytest.raises(ModelError, match="more image placeholder runs"):
        model.rope_positions(ids, grids[:3])
