"""Qwen3.5 / Qwen3.5-MoE vision-language directories served: `LLM.generate` with images equals
transformers' greedy generation: the paged engine keeps the hybrid language model's recurrent
states beside its attention blocks while the image rows arrive split over chunked-prefill steps,
rotates every token by its interleaved M-RoPE position and decodes from the prompt's largest
position + 1; a text-only prompt beside decodes as transformers' does. A repeated image prompt
starts from its cached blocks and the recurrent state's snapshot there."""

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


def test_a_repeated_image_prompt_starts_from_its_cached_prefix_and_decodes_the_same(tmp_path):
    """Prefix caching over the hybrid with an image: the second request's prompt (the image among
    its first blocks) is found in the cache, its recurrent state taken from the snapshot at the
    last cached block (one every block here), and it decodes transformers' tokens as the first
    did; the image is encoded once."""
    from tessera.infer import EngineConfig, LLMEngine

    hf = hf_qwen3_5_vl("qwen3_5", seed=6)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    engine = LLMEngine.from_dir(tmp_path / "hf", EngineConfig(block_size=4, state_snapshot_tokens=4))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    image = engine.pixel_values(sample_images()[1])
    cache, encoder = engine.blocks.cache, engine.executor.local.encoder
    prompt = [5, 6, 7, VISION_START, IMAGE, VISION_END, 20, 21, 22]

    def run():
        rid = engine.add_request(prompt, greedy, images=[image])
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done[rid].token_ids

    first = run()
    hits = cache.hit_tokens
    assert run() == first == hf_greedy(hf, prompt, [sample_images()[1]], 4)
    assert cache.hit_tokens > hits  # the image's blocks (and a state snapshot) came from the prefix cache
    assert (encoder.misses, encoder.hits) == (1, 0)  # encoded once
