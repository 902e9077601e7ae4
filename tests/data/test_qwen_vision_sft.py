"""Image-text conversations as Qwen2-VL / Qwen2.5-VL samples (tessera.data.vision_sft.load_qwen_vision_sft):
with Qwen's chat template the tokens are transformers' (the tokenizer's rendering of the image parts,
each `<|image_pad|>` widened to the image's grid / merge^2 as Qwen2VLProcessor does), the patch rows
and grids are Qwen2VLImageProcessorPil's, native-resolution images of several sizes each take their
own number of tokens, the loss is on the answer only, and text that gives a vision token is refused."""

import re
import shutil

import numpy as np
import pytest
from PIL import Image
from tokenizers import AddedToken

from tessera.config.errors import DataError
from tessera.data.qwen_image_processor import QwenImageProcessor
from tessera.data.sft import tokenize_conversation
from tessera.data.tokenizer import Tokenizer, default_tokenizer
from tessera.data.vision_sft import load_qwen_vision_sft
from tests.models.qwen_vl_cases import MAX_PIXELS, MIN_PIXELS, hf_processor
from tests.train.runs import ROOT

SHAPES = ROOT / "examples" / "data" / "shapes"
SEQ = 96
# Qwen2-VL-Instruct's chat template (its chat_template.json), verbatim
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


@pytest.fixture(scope="module")
def qwen_tokenizer_dir(tmp_path_factory):
    """The bundled BPE with Qwen's special tokens and chat template, saved as transformers saves one."""
    base = default_tokenizer().backend
    base.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    path = tmp_path_factory.mktemp("qwen_tokenizer")
    Tokenizer(base, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE).save(path)
    return path


def _processor() -> QwenImageProcessor:
    return QwenImageProcessor.from_dict(hf_processor().to_dict())


def _load(tokenizer, path, seq_len=SEQ):
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    return load_qwen_vision_sft([path], tokenizer, _processor(), ids["<|image_pad|>"], ids["<|vision_start|>"],
                                ids["<|vision_end|>"], seq_len)


def test_samples_equal_transformers_chat_template_and_processor(qwen_tokenizer_dir, tmp_path, write_jsonl):
    from transformers import AutoTokenizer

    for name in ("green_ellipse.png", "red_bar.png", "blue_tower.png"):
        shutil.copy(SHAPES / name, tmp_path / name)
    question = [{"type": "image", "image": "green_ellipse.png"}, {"type": "text", "text": "Which is green, "},
                {"type": "image_url", "image_url": {"url": "red_bar.png"}}, {"type": "text", "text": " or this?"}]
    records = [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "The first."},
                      {"role": "user", "content": "And the colour of the second?"},
                      {"role": "assistant", "content": "Red."}]},
        {"image": "blue_tower.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour is it?"},
                                                      {"from": "gpt", "value": "Blue."}]},
    ]
    tokenizer = Tokenizer.from_path(qwen_tokenizer_dir)
    samples = _load(tokenizer, write_jsonl(tmp_path / "c.jsonl", records))
    hf_tok, hf_proc = AutoTokenizer.from_pretrained(qwen_tokenizer_dir), hf_processor()
    parts = [[{"type": "image"} if p["type"] != "text" else p for p in question],
             [{"type": "image"}, {"type": "text", "text": "\nWhat colour is it?"}]]
    chats = [[{"role": "user", "content": parts[0]}, {"role": "assistant", "content": "The first."},
              {"role": "user", "content": "And the colour of the second?"}, {"role": "assistant", "content": "Red."}],
             [{"role": "user", "content": parts[1]}, {"role": "assistant", "content": "Blue."}]]
    images = [[Image.open(tmp_path / "green_ellipse.png"), Image.open(tmp_path / "red_bar.png")],
              [Image.open(tmp_path / "blue_tower.png")]]
    image_pad = tokenizer.token_to_id("<|image_pad|>")
    for sample, chat, pictures in zip(samples, chats, images, strict=True):
        want = hf_proc(pictures, return_tensors="np")
        assert np.array_equal(sample.pixels, want["pixel_values"])
        assert np.array_equal(sample.grids, want["image_grid_thw"])
        # Qwen2VLProcessor's rule: each <|image_pad|> of the rendered chat becomes grid / merge^2 of them
        text = hf_tok.apply_chat_template(chat, tokenize=False)
        for grid in want["image_grid_thw"]:
            text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(np.prod(grid)) // 4), 1)
        ids = hf_tok(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
        got = sample.tokens.tolist()
        assert got[:len(ids)] == ids and not any(got[len(ids):])
        assert (sample.tokens == image_pad).sum() == sum(int(np.prod(g)) // 4 for g in want["image_grid_thw"])
    # images of other sizes take other numbers of tokens: 40x24 -> 6x10 patches, 32x16 -> 4x8, 16x32 -> 8x4
    assert samples[0].grids.tolist() == [[1, 6, 10], [1, 4, 8]] and samples[1].grids.tolist() == [[1, 8, 4]]
    # the loss is on the answers (through <|im_end|>) only: as text SFT of the same chat without images
    end = tokenizer.token_to_id("<|im_end|>")
    answers = [tokenizer.decode(sample.tokens[sample.loss_mask]) for sample in samples]
    assert answers == ["The first.<|im_end|>Red.<|im_end|>", "Blue.<|im_end|>"]
    text_ids, text_mask = tokenize_conversation(tokenizer, [{"role": "user", "content": "x"},
                                                            {"role": "assistant", "content": "Blue."}])
    assert [t for t, m in zip(text_ids, text_mask) if m] == samples[1].tokens[samples[1].loss_mask].tolist()
    assert end in samples[1].tokens[samples[1].loss_mask]


def test_the_bundled_pairs_take_each_image_its_own_tokens(tokenizer):
    proc = QwenImageProcessor(size={"shortest_edge": 256, "longest_edge": 1024}, patch_size=4)
    image, start, end = 4099, 4097, 4098
    samples = load_qwen_vision_sft([SHAPES / "shapes.jsonl", SHAPES / "sizes.jsonl"], tokenizer, proc, image, start,
                                   end, 64)
    assert len(samples) == 12
    for s in samples:
        ids = s.tokens.tolist()
        assert s.grids.shape == (len(s.grids), 3) and s.pixels.shape == (int(s.grids.prod(1).sum()), 96)
        assert ids.count(start) == ids.count(end) == len(s.grids)
        assert ids.count(image) == sum(int(g.prod()) // 4 for g in s.grids)
        assert not s.loss_mask[[i for i, t in enumerate(ids) if t in (image, start, end)]].any()
    assert [g.tolist() for g in (s.grids for s in samples[7:])] == [[], [[1, 4, 8]], [[1, 8, 4]],
                                                                    [[1, 6, 10], [1, 4, 4]], [[1, 6, 10]]]
    # the pixels are the processor's, image by image, in order
    two = samples[10]
    rows = np.concatenate([proc(Image.open(SHAPES / n))[0] for n in ("green_ellipse.png", "red_circle.png")])
    assert np.array_equal(two.pixels, rows)


@pytest.mark.parametrize("text", ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
def test_text_that_gives_a_vision_token_is_refused(qwen_tokenizer_dir, tmp_path, write_jsonl, text):
    tokenizer = Tokenizer.from_path(qwen_tokenizer_dir)
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": f"a {text} b"},
                                                            {"role": "assistant", "content": "x"}]}])
    with pytest.raises(DataError, match=re.escape(f"t.jsonl:1: the text tokenizes to the image token id(s) "
                                                  f"[{tokenizer.token_to_id(text)}]")):
        _load(tokenizer, path)


def test_a_conversation_longer_than_seq_len_names_its_image_tokens(tokenizer, tmp_path, write_jsonl):
    shutil.copy(SHAPES / "green_ellipse.png", tmp_path / "g.png")
    path = write_jsonl(tmp_path / "long.jsonl", [{"image": "g.png", "conversations": [
        {"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}]}])
    proc = QwenImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=4)
    with pytest.raises(DataError, match=r"long.jsonl:1: .*1 image\(s\) \(17 image tokens\), more than train.seq_len"):
        load_qwen_vision_sft([path], tokenizer, proc, 4099, 4097, 4098, 16)
