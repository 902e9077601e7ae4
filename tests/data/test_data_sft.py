import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import (
    BatchIterator,
    IndexedDataset,
    PackedDataset,
    Tokenizer,
    conversation_from_record,
    index_paths,
    mask_prefix,
    preprocess_sft,
    tokenize_conversation,
)

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in Python?"},
        {"role": "assistant", "content": "print(2 + 2)  # 4"}]


def masked_runs(tokenizer, ids, mask):
    """The decoded text of each maximal run of loss tokens."""
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_exactly_the_answers_and_their_end_token(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CHAT)
    rendered = tokenizer.apply_chat_template(CHAT)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False) and len(mask) == len(ids)
    assert masked_runs(tokenizer, ids, mask) == ["4.<|end|>", "print(2 + 2)  # 4<|end|>"]
    prompt = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert prompt == ("<|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n"
                      "\n<|user|>\nAnd in Python?<|end|>\n<|assistant|>\n\n")


def test_prompt_response_records_and_the_plain_template(tokenizer):
    record = {"system": "Be kind.", "prompt": "Say hi", "response": "Hi there!"}
    messages = conversation_from_record(record)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert masked_runs(tokenizer, ids, mask) == ["Hi there!<|end|>"]
    plain = Tokenizer(tokenizer.backend, eos_token="<|endoftext|>")  # same vocabulary, no chat template
    assert not plain.has_chat_template
    ids, mask = tokenize_conversation(plain, messages)
    assert plain.decode(ids) == "System:\nBe kind.\n\nUser:\nSay hi\n\nAssistant:\nHi there!<|endoftext|>\n\n"
    assert masked_runs(plain, ids, mask) == ["Hi there!<|endoftext|>"]


def test_templates_with_generation_blocks_and_templates_that_rewrite_history(tokenizer):
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
              "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ids, mask = tokenize_conversation(tokenizer, CHAT[1:3], chat_template=marked)
    assert masked_runs(tokenizer, ids, mask) == ["4.<|end|>"]
    counting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="renders turn 1 differently"):
        tokenize_conversation(tokenizer, CHAT[1:3], chat_template=counting)


@pytest.mark.parametrize("record, message", [
    ({"text": "x"}, "expected 'messages', or 'prompt' and 'response' \\(fields present: text\\)"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0 must be an object with string 'role'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no 'assistant' message"),
    ({"prompt": "a", "response": None}, "field 'response' must be a string"),
])
def test_bad_records(tokenizer, tmp_path, write_jsonl, record, message):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "fine", "response": "ok"}, record])
    with pytest.raises(DataError, match=r"sft\.jsonl:2: " + message):
        preprocess_sft([path], tmp_path / "out", tokenizer, show_progress=False)
    assert not any(p.exists() for p in index_paths(tmp_path / "out") + index_paths(mask_prefix(tmp_path / "out")))


def test_preprocessed_sft_packs_tokens_with_their_mask(tokenizer, tmp_path, write_jsonl):
    records = [{"messages": CHAT}, {"prompt": "Name a prime.", "response": "7"}] * 3
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    stats = preprocess_sft([path], tmp_path / "sft", tokenizer, show_progress=False)
    tokens, mask = IndexedDataset(tmp_path / "sft"), IndexedDataset(mask_prefix(tmp_path / "sft"))
    assert len(tokens) == stats.documents == 6 and mask.dtype == np.uint8
    assert tokens.offsets.tolist() == mask.offsets.tolist()
    expected_ids, expected_mask = tokenize_conversation(tokenizer, conversation_from_record(records[1]))
    assert tokens[1].tolist() == expected_ids and mask[1].tolist() == expected_mask
    assert stats.loss_tokens == int(mask.get(0, mask.num_tokens).sum()) < stats.tokens

    dataset = PackedDataset(tmp_path / "sft", seq_len=16)
    assert dataset.loss_mask is not None and len(dataset) == (tokens.num_tokens - 1) // 16
    batch = BatchIterator(dataset, global_batch_size=len(dataset), shuffle=False).next_batch()
    stream_mask = mask.get(0, mask.num_tokens).astype(bool)
    for row in range(len(dataset)):
        window = slice(row * 16, row * 16 + 17)
        assert batch.tokens[row].tolist() == tokens.get(0, tokens.num_tokens)[window].tolist()
        assert batch.loss_mask[row].tolist() == stream_mask[window].tolist()
    assert 0 < int(batch.loss_mask.sum()) < batch.loss_mask.numel()


def test_misaligned_mask_is_refused(tokenizer, tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}] * 4)
    preprocess_sft([path], tmp_path / "a", tokenizer, show_progress=False)
    other = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a longer prompt", "response": "r"}] * 4)
    preprocess_sft([other], tmp_path / "b", tokenizer, show_progress=False)
    for mask_file, source in zip(index_paths(mask_prefix(tmp_path / "a")), index_paths(mask_prefix(tmp_path / "b"))):
        mask_file.write_bytes(source.read_bytes())
    with pytest.raises(DataError, match="loss mask does not line up"):
        PackedDataset(tmp_path / "a", seq_len=4)
