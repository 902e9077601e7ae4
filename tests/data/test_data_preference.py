"""Preference pairs (tessera/data/preference.py): a record's prompt and its two answers become two
rows of one sample, rendered by the chat template, each answer's tokens (and only those) in its
mask; what cannot be scored or does not fit the context is refused in one line naming the record."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import Tokenizer, collate, tokenize_conversation
from tessera.data.preference import load_preference_file, preference_sample
from tests.data.test_data_sft import masked_runs

SEQ = 48


def _row(sample, i):
    return sample.tokens[i].tolist(), sample.loss_mask[i].tolist()


def test_text_records_are_a_user_turn_and_an_assistant_turn_with_only_the_answer_masked(tokenizer):
    record = {"system": "Be kind.", "prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5, I think."}
    sample = preference_sample(tokenizer, record, SEQ, "r")
    assert sample.tokens.shape == sample.loss_mask.shape == (2, SEQ + 1) and sample.tokens.dtype == np.int64
    for i, answer in enumerate(["4.", "5, I think."]):
        ids, mask = _row(sample, i)
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": answer}]
        want_ids, want_mask = tokenize_conversation(tokenizer, messages)  # as an SFT record of the same turns
        n = len(want_ids)
        assert ids[:n] == want_ids and mask[:n] == [bool(m) for m in want_mask]
        assert ids[n:] == [0] * (SEQ + 1 - n) and not any(mask[n:])  # padding, never scored
        assert masked_runs(tokenizer, ids, mask) == [f"{answer}<|end|>"]
    # both rows open with the same prompt
    start = int(np.argmax(sample.loss_mask[0]))
    assert start == int(np.argmax(sample.loss_mask[1])) and (sample.tokens[0, :start] == sample.tokens[1, :start]).all()


def test_chat_messages_score_the_answers_turns_and_not_the_prompts_assistant_turns(tokenizer):
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Name a prime."}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "7"}],
              "rejected": [{"role": "assistant", "content": "9"}]}
    sample = preference_sample(tokenizer, record, SEQ, "r")
    assert masked_runs(tokenizer, *_row(sample, 0)) == ["7<|end|>"]
    assert masked_runs(tokenizer, *_row(sample, 1)) == ["9<|end|>"]
    assert "Hello!" in tokenizer.decode(sample.tokens[0].tolist())


def test_a_tokenizer_without_a_template_renders_with_the_plain_one(tokenizer):
    plain = Tokenizer(tokenizer.backend, eos_token="<|endoftext|>")
    sample = preference_sample(plain, {"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}, SEQ, "r")
    ids, mask = _row(sample, 0)
    assert plain.decode([t for t, m in zip(ids, mask) if t or m]).startswith("User:\nSay hi\n\nAssistant:\nHi!")
    assert masked_runs(plain, ids, mask) == ["Hi!<|endoftext|>"]


def test_a_file_is_a_dataset_of_pairs_that_collates_to_pair_batches(tokenizer, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"}
                                              for i in range(3)])
    data = load_preference_file(path, tokenizer, SEQ, vocab_size=tokenizer.vocab_size)
    assert len(data) == 3 and data.seq_len == SEQ
    batch = collate([data[0], data[2]])
    assert batch.tokens.shape == batch.loss_mask.shape == (2, 2, SEQ + 1)
    assert data.answer_tokens == int(batch.loss_mask[:, :, 1:].sum()) + int(data[1].loss_mask[:, 1:].sum())


@pytest.mark.parametrize("record,message", [
    ({"prompt": "Q", "chosen": "yes"}, r"p.jsonl:1: a preference record needs 'prompt', 'chosen' and 'rejected'; "
                                       r"missing 'rejected' \(fields present: chosen, prompt\)"),
    ({"chosen": "a", "rejected": "b", "text": "t"}, r"missing 'prompt' \(fields present: chosen, rejected, text\)"),
    ({"prompt": "Q", "chosen": "", "rejected": "no"}, r"p.jsonl:1: 'chosen' is empty: an answer needs at least one"),
    ({"prompt": "Q", "chosen": "yes", "rejected": "  \n"}, r"'rejected' is empty"),
    ({"prompt": "Q", "chosen": [{"role": "user", "content": "x"}], "rejected": "no"},
     r"'chosen' holds no 'assistant' message, so it has nothing to score"),
    ({"prompt": [], "chosen": "yes", "rejected": "no"}, r"'prompt' must be a string or a non-empty list"),
    ({"prompt": "Q", "chosen": 3, "rejected": "no"}, r"'chosen' must be a string or a non-empty list"),
    ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
     r"'prompt' message 0 must be an object with string 'role' and 'content'"),
    ({"prompt": "Q", "system": 1, "chosen": "a", "rejected": "b"}, r"field 'system' must be a string"),
    ({"prompt": "x" * 200, "chosen": "a", "rejected": "b"},
     r"p.jsonl:1: the prompt is \d+ tokens, longer than the context of train.seq_len \+ 1 = 49 tokens, which "
     r"leaves no room for an answer"),
    ({"prompt": "Q", "chosen": "a", "rejected": "word " * 60},
     r"p.jsonl:1: the prompt and 'rejected' are \d+ tokens, longer than the context of train.seq_len \+ 1 = 49 "
     r"tokens; raise train.seq_len"),
])
def test_bad_records_are_refused_in_one_line_naming_the_record(tokenizer, write_jsonl, tmp_path, record, message):
    path = write_jsonl(tmp_path / "p.jsonl", [record])
    with pytest.raises(DataError, match=message) as caught:
        load_preference_file(path, tokenizer, SEQ)
    assert "\n" not in str(caught.value)


def test_a_token_past_the_models_vocabulary_and_an_empty_file_are_refused(tokenizer, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "chosen": "yes", "rejected": "no"}])
    with pytest.raises(DataError, match=r"p.jsonl:1: token id \d+ is outside model.vocab_size=64: the tokenizer"):
        load_preference_file(path, tokenizer, SEQ, vocab_size=64)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no documents found"):
        load_preference_file(tmp_path / "empty.jsonl", tokenizer, SEQ)
