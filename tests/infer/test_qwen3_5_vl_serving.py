"""Qwen3.5 / Qwen3.5-MoE vision-language directories served: `LLM.generate` with images equals
transformers' greedy generation: the paged engine keeps the hybrid language model's recurrent
states beside its attention blocks while the image rows arrive split over chunked-prefill steps,
rotates every token by its interleaved M-RoPE position and decodes from the prompt's largest
position + 1; a text-only prompt beside decodes as transformers' does."""

import pytest

from tessera.infer import LLM, SamplingParams
from tests.infer.test_qwen_vl_serving import hf_greedy
from tests.models.qwen3_5_vl_cases import FAMILIES, hf_qwen3_5_vl
from tests.models.qwen_vl_cases import IMAGE, VISION_END, VISION_START, hf_processor, sample_images

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_images_matches_transformers(family, tmp_path):
    hf = hf_qwen3_5_vl(family, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    pics = sample_images()
    two = [5, 9, VISION_START, IMAGE, VISION_END, 17, 3, VISION_START, IMAGE, VISION_END, 40, 41]
    one = [8, VISION_START, IMAGE, VISION_END, 12, 13]
    text = [4, 5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    # a budget of 8 tokens a step: every image's rows are split over several chunks
    with LLM(str(tmp_path / "hf"), block_size=4, max_num_batched_tokens=8) as llm:
        out = llm.generate([two, one, text], greedy, images=[[pics[0], pics[2]], [pics[3]], []])
    assert out[0].token_ids == hf_greedy(hf, two, [pics[0], pics[2]], 7)
    assert out[1].token_ids == hf_greedy(hf, one, [pics[3]], 7)
    assert out[2].token_ids == hf_greedy(hf, text, [], 7)
