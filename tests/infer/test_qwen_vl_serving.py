"""Qwen2-VL / Qwen2.5-VL directories served: `LLM.generate` with images equals transformers' greedy
generation (images of several sizes, two in one prompt, chunked prefill splitting them over steps,
a text-only prompt beside): the paged engine rotates every token by its M-RoPE position, decodes
continuing from the prompt's largest position + 1 per request. A repeated image reuses its KV
blocks and its encoder output and decodes the same; a converted checkpoint serves the same; what is
not served for vision-language models is refused by name."""

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.models.qwen_vl_cases import (
    IMAGE,
    VERSIONS,
    VISION_END,
    VISION_START,
    hf_processor,
    hf_qwen_vl,
    mm_token_types,
    sample_images,
)

transformers = pytest.importorskip("transformers")


def _served_dir(version, tmp_path):
    hf = hf_qwen_vl(version, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", hf


def hf_greedy(hf, prompt: list[int], images, steps: int) -> list[int]:
    """transformers' greedy tokens for `prompt` with each image mark widened as its processor says."""
    ids = list(prompt)
    kwargs = {}
    if images:
        out = hf_processor()(images, return_tensors="pt")
        counts = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
        ids = [t for tok in prompt for t in ([IMAGE] * next(counts) if tok == IMAGE else [tok])]
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    x = torch.tensor([ids])
    with torch.no_grad():
        got = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=mm_token_types(x),
                          max_new_tokens=steps, do_sample=False, **kwargs)
    return got[0, len(ids):].tolist()


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_with_images_matches_transformers(version, tmp_path):
    path, hf = _served_dir(version, tmp_path)
    pics = sample_images()
    two = [5, 9, VISION_START, IMAGE, VISION_END, 17, 3, VISION_START, IMAGE, VISION_END, 40, 41]
    one = [8, VISION_START, IMAGE, VISION_END, 12, 13]
    text = [4, 5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    # a budget of 8 tokens a step: every image's rows are split over several chunks
    with LLM(str(path), block_size=4, max_num_batched_tokens=8) as llm:
        out = llm.generate([two, one, text], greedy, images=[[pics[0], pics[2]], [pics[3]], []])
    assert out[0].token_ids == hf_greedy(hf, two, [pics[0], pics[2]], 7)
    assert out[1].token_ids == hf_greedy(hf, one, [pics[3]], 7)
    assert out[2].token_ids == hf_greedy(hf, text, [], 7)


def test_a_repeated_image_reuses_its_kv_blocks_and_decodes_the_same(tmp_path):
    path, hf = _served_dir("qwen2_5_vl", tmp_path)
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4))
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
    assert cache.hit_tokens > hits  # the image's blocks came from the prefix cache
    assert (encoder.misses, encoder.hits) == (1, 0)  # encoded once


def test_a_converted_checkpoint_serves_the_same_and_refusals_name_the_family(tmp_path):
    from tessera.cli import main as tessera_main

    path, hf = _served_dir("qwen2_vl", tmp_path)
    assert tessera_main(["convert", str(path), str(tmp_path / "ckpt")]) == 0
    prompt = [7, VISION_START, IMAGE, VISION_END, 9]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "ckpt"), block_size=4) as llm:
        out = llm.generate([prompt], greedy, images=[[sample_images()[0]]])
    assert out[0].token_ids == hf_greedy(hf, prompt, [sample_images()[0]], 5)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 .*vision-language model family 'qwen2_vl'"):
        LLM(str(path), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="speculative.*family 'qwen2_vl'"):
        LLM(str(path), speculative={"method": "prompt_lookup", "num_tokens": 2})
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4))
    with pytest.raises(ConfigError, match=r"a Qwen2-VL image must be \(patch rows"):
        engine.with_images([IMAGE], [engine.pixel_values(sample_images()[0])[0]])  # rows without their grid
