"""Image-text conversations for vision-language SFT (tessera.data.vision_sft): both record formats,
images from relative paths, file:// and data: urls, image placeholders widened where the images go,
the loss on the answers only, and every bad record refused with a DataError naming its line."""

import base64
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from tessera.config.errors import DataError
from tessera.config.vision import VisionConfig
from tessera.data.image_processor import ImageProcessor
from tessera.data.sft import tokenize_conversation
from tessera.data.vision_sft import load_vision_sft, split_samples
from tests.train.runs import ROOT

SHAPES = ROOT / "examples" / "data" / "shapes"
IMAGE_ID, T, SEQ = 4096, 16, 64
PROCESSOR = ImageProcessor.for_vision(VisionConfig(image_size=16, patch_size=4))


def _load(tokenizer, path, seq_len=SEQ):
    return load_vision_sft([path], tokenizer, PROCESSOR, IMAGE_ID, T, seq_len)


def _answer_runs(tokenizer, sample):
    ids, mask = sample.tokens.tolist(), sample.loss_mask.tolist()
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


class _Row:
    def __init__(self, ids, mask):
        self.tokens, self.loss_mask = np.array(ids), np.array(mask, dtype=bool)


def test_both_formats_and_every_image_source_give_the_same_sample(tokenizer, tmp_path, write_jsonl):
    shutil.copy(SHAPES / "red_circle.png", tmp_path / "red.png")
    data = "data:image/png;base64," + base64.b64encode((SHAPES / "red_circle.png").read_bytes()).decode()
    question = [{"type": "image", "image": "red.png"}, {"type": "text", "text": "\nWhat is this?"}]
    records = [
        {"image": "red.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                               {"from": "gpt", "value": "A red circle."}]},
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "A red circle."}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                                   question[1]]},
                      {"role": "assistant", "content": "A red circle."}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": f"file://{tmp_path}/red.png"},
                                                   question[1]]},
                      {"role": "assistant", "content": "A red circle."}]},
    ]
    samples = _load(tokenizer, write_jsonl(tmp_path / "c.jsonl", records))
    assert len(samples) == 4
    for s in samples[1:]:
        assert np.array_equal(s.tokens, samples[0].tokens) and np.array_equal(s.loss_mask, samples[0].loss_mask)
        assert np.array_equal(s.pixels, samples[0].pixels)
    s = samples[0]
    want_pixels = PROCESSOR(Image.open(SHAPES / "red_circle.png"))
    assert s.pixels.shape == (1, 3, 16, 16) and np.array_equal(s.pixels[0], want_pixels)
    # the image's T placeholders stand where "<image>" was: after the user header, before the question
    ids = s.tokens.tolist()
    first = ids.index(IMAGE_ID)
    assert ids[first:first + T] == [IMAGE_ID] * T and ids.count(IMAGE_ID) == T
    # the text around the image is tokenized piece by piece, as the server tokenizes a chat request
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"},
                                          {"role": "assistant", "content": "A red circle."}])
    before, after = text.split("<image>")
    want = (tokenizer.encode(before, add_special_tokens=False) + [IMAGE_ID] * T
            + tokenizer.encode(after, add_special_tokens=False))
    assert ids[:len(want)] == want and not any(ids[len(want):])
    # the loss is on the answer (and its end token) only, never on the image
    text_only = [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A red circle."}]
    text_ids, text_mask = tokenize_conversation(tokenizer, text_only)
    [run] = _answer_runs(tokenizer, s)
    assert run.startswith("A red circle.") and [run] == _answer_runs(tokenizer, _Row(text_ids, text_mask))
    assert not s.loss_mask[first:first + T].any()


def test_text_only_rows_equal_text_sft_and_carry_no_images(tokenizer, tmp_path, write_jsonl):
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    [s] = _load(tokenizer, write_jsonl(tmp_path / "t.jsonl", [{"messages": chat}]))
    ids, mask = tokenize_conversation(tokenizer, chat)
    assert s.tokens[:len(ids)].tolist() == ids and s.loss_mask[:len(ids)].astype(int).tolist() == mask
    assert not s.tokens[len(ids):].any() and not s.loss_mask[len(ids):].any()  # padding, never trained on
    assert s.pixels.shape == (0, 3, 16, 16)


def test_the_bundled_pairs_load(tokenizer):
    samples = _load(tokenizer, SHAPES / "shapes.jsonl")
    assert len(samples) == 8
    assert [len(s.pixels) for s in samples] == [1, 1, 1, 1, 1, 1, 1, 0]
    assert all((s.tokens == IMAGE_ID).sum() == T * len(s.pixels) for s in samples)
    train, valid = split_samples(samples, 0.2)
    assert len(train) == 6 and len(valid) == 2 and valid[-1] is samples[-1]


@pytest.mark.parametrize("record, problem", [
    ({"image": "missing.png", "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}]},
     "cannot be read"),
    ({"image": "red.png", "conversations": [{"from": "human", "value": "no mark"}, {"from": "gpt", "value": "x"}]},
     "marks 0 image place(s)"),
    ({"image": "http://example.com/a.png", "conversations": [{"from": "human", "value": "<image>"},
                                                              {"from": "gpt", "value": "x"}]}, "web address"),
    ({"image": "notes.png", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]},
     "not an image"),
    ({"image": "red.png", "conversations": [{"from": "human", "value": "<image>" + " long" * 80},
                                            {"from": "gpt", "value": "x"}]}, "more than train.seq_len + 1"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "conversations[0] must be"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "x"}]},
     "content parts are"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "nothing to train on"),
    ({"text": "plain"}, "expected 'messages'"),
])
def test_bad_records_are_refused_naming_the_line(tokenizer, tmp_path, write_jsonl, record, problem):
    shutil.copy(SHAPES / "red_circle.png", tmp_path / "red.png")
    (tmp_path / "notes.png").write_bytes(b"not a png at all")
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "ok"},
                                                              {"role": "assistant", "content": "ok"}]}, record])
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{re.escape(problem)}"):
        _load(tokenizer, path)


def test_an_image_token_the_text_gives_is_refused(tokenizer, tmp_path, write_jsonl):
    token = tokenizer.encode("Blue", add_special_tokens=False)[0]
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "Blue"},
                                                            {"role": "assistant", "content": "x"}]}])
    with pytest.raises(DataError, match="tokenizes to the image token id"):
        load_vision_sft([path], tokenizer, PROCESSOR, token, T, SEQ)
