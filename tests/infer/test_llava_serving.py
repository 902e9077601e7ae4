"""A LLaVA directory served: `LLM.generate` with images equals transformers' greedy generation
(several images, chunked prefill, a text-only prompt beside); a repeated image reuses its KV blocks
(the block manager's hit counters) and its encoder output; the engine refuses what it does not
serve for vision-language models by name."""

import numpy as np
import pytest

from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.infer.tiny_llava import IMAGE, hf_greedy, images, png

transformers = pytest.importorskip("transformers")


def test_generate_with_images_matches_transformers(llava):
    path, hf = llava
    two = [5, 9, IMAGE, 17, 3, IMAGE, 40, 41]
    one = [8, IMAGE, 12, 13]
    text = [4, 5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    # a budget of 8 tokens a step: every image's rows are split over several chunks
    with LLM(str(path), block_size=4, max_num_batched_tokens=8) as llm:
        out = llm.generate([two, one, text], greedy, images=[images(), [png(images()[1])], []])
    assert out[0].token_ids == hf_greedy(hf, two, images(), 7)
    assert out[1].token_ids == hf_greedy(hf, one, [images()[1]], 7)
    assert out[2].token_ids == hf_greedy(hf, text, [], 7)


def test_a_repeated_image_reuses_its_kv_blocks_and_its_encoder_output(llava):
    path, _ = llava
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first, other = (engine.pixel_values(im) for im in images())
    cache, encoder = engine.blocks.cache, engine.executor.local.encoder

    def run(ids, pics):
        engine.add_request(ids, greedy, images=pics)
        while engine.has_unfinished():
            engine.step()

    prompt = [5, 6, 7, 8, IMAGE, 20, 21, 22, 23, 24]  # the image fills positions 4..19; the prompt ends at 24
    run(prompt, [first])
    assert (encoder.misses, encoder.hits) == (1, 0)
    hits = cache.hit_tokens
    run(prompt, [first])  # same tokens, same image: every full block but the last position's comes from the cache
    length = len(prompt) - 1 + engine.vision.cfg.image_tokens
    assert cache.hit_tokens - hits == (length - 1) // 4 * 4
    assert (encoder.misses, encoder.hits) == (1, 0)  # nothing left to encode
    hits = cache.hit_tokens
    run(prompt, [other])  # same tokens, another image: only the blocks before the image are shared
    assert cache.hit_tokens - hits == 4
    assert encoder.misses == 2
    run([30, 31, IMAGE, 32], [first])  # the first image after other text: its features come from the encoder cache
    assert (encoder.misses, encoder.hits) == (2, 1)


def test_bad_image_requests_are_refused_by_name(llava):
    path, _ = llava
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, limit_mm_per_prompt={"image": 1}))
    pix = engine.pixel_values(images()[0])
    with pytest.raises(ConfigError, match="at most 1 per prompt"):
        engine.add_request([1, IMAGE, IMAGE], images=[pix, pix])
    with pytest.raises(ConfigError, match="marks 2 image place"):
        engine.add_request([1, IMAGE, IMAGE], images=[pix])
    with pytest.raises(ConfigError, match=r"pixel values must be \[3, 30, 30\]"):
        engine.add_request([1, IMAGE], images=[pix[:, :20]])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("option", [dict(tensor_parallel_size=2), dict(lora_adapters={"a": "/nowhere"}),
                                    dict(quantization="int8"), dict(kv_role="prefill")])
def test_features_not_served_for_llava_are_refused_by_name(llava, option):
    path, _ = llava
    key = next(iter(option))
    with pytest.raises(ConfigError, match=f"{key}=.*not supported for the vision-language model family 'llava'"):
        LLMEngine.from_dir(path, EngineConfig(**option))


def test_a_text_model_takes_no_images(tmp_path):
    from tests.infer.tiny_models import write_model

    write_model(tmp_path, "llama")
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4))
    with pytest.raises(ConfigError, match="takes no images"):
        engine.add_request([1, 2], images=[np.zeros((3, 4, 4), dtype=np.float32)])


def test_a_converted_checkpoint_serves_the_same(llava, tmp_path):
    from tessera.checkpoint.convert import convert

    path, hf = llava
    convert(path, tmp_path / "ckpt")
    prompt = [5, IMAGE, 17, 3]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "ckpt"), block_size=4) as llm:
        assert llm.tokenizer is not None
        out = llm.generate([prompt], greedy, images=[[images()[0]]])
    assert out[0].token_ids == hf_greedy(hf, prompt, [images()[0]], 5)
