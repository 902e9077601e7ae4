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
    sample_images,
)

transformers = pytest.importorskip("transformers")


def _served_dir(version, tmp_path):
    hf = hf_qwen_vl(version, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", hf


def hf_greedy(hf, prompt: list[int], images, steps: int, image_id: int = IMAGE) -> list[int]:
    """transformers' greedy tokens for `prompt` with each image mark widened as its processor says."""
    ids = list(prompt)
    kwargs = {}
    if images:
        out = hf_processor()(images, return_tensors="pt")
        counts = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
        ids = [t for tok in prompt for t in ([image_id] * next(counts) if tok == image_id else [tok])]
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    x = torch.tensor([ids])
    with torch.no_grad():
        got = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == image_id).int(),
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


def test_chat_with_image_url_parts_equals_transformers(tmp_path):
    """`/v1/chat/completions` over real HTTP: a data: URL image part becomes the image's placeholders
    between the vision start and end tokens, as Qwen2-VL's chat template writes it; requests with a
    non-image, a truncated file or a decompression bomb get a 400 naming it and the server goes on."""
    import base64
    import io

    import httpx

    from tests.data.test_image_processor import _png_header
    from tests.hang_guard import HANG_S
    from tests.infer.running_server import RunningServer
    from tests.infer.test_llava_server import chat, data_url, image_part
    from tests.infer.tiny_models import VOCAB, char_tokenizer, save_tokenizer

    hf = hf_qwen_vl("qwen2_5_vl", seed=5, vocab=VOCAB)
    hf.save_pretrained(tmp_path / "hf")
    hf_processor().save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    image, start, end = VOCAB - 1, VOCAB - 3, VOCAB - 2
    buf = io.BytesIO()
    sample_images()[1].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "!"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    engine = LLMEngine.from_dir(tmp_path / "hf", EngineConfig(block_size=4))
    with RunningServer(engine, name="tiny") as server:
        # a bad image fails only its own request, with a 400 naming the problem (the code LLaVA's
        # requests go through, here with Qwen's processor behind it)
        for bad, problem in ((data_url(b"hello, not an image"), "not an image"),
                             (data_url(buf.getvalue()[:60]), "truncated"),
                             (data_url(_png_header(200_000, 200_000)), "decompression bomb")):
            refused = chat(server, [image_part(bad), {"type": "text", "text": "?"}])
            assert refused.status_code == 400 and problem in refused.json()["error"]["message"], refused.text
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    tok = char_tokenizer()

    def enc(text):
        return tok.encode(text, add_special_tokens=False).ids

    ids = enc("<user>see ") + [start, image, end] + enc("!\n<assistant>")
    from PIL import Image

    decoded = Image.open(io.BytesIO(buf.getvalue()))
    want = hf_greedy(hf, ids, [decoded], 6, image_id=image)
    assert tok.encode(r.json()["choices"][0]["message"]["content"], add_special_tokens=False).ids == want

