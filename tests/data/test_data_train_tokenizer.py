import json

import pytest

from tessera.data import DEFAULT_TOKENIZER_DIR, Tokenizer, build_stdlib_corpus
from tessera.data.train_tokenizer import SPECIAL_TOKENS, main, train_bpe_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n",
         "naïve café ✓\n"] * 30


def test_training_is_deterministic_and_byte_level():
    one = train_bpe_tokenizer(TEXTS, vocab_size=300)
    two = train_bpe_tokenizer(TEXTS, vocab_size=300)
    assert one.backend.to_str() == two.backend.to_str()
    assert [one.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    unseen = "ζ unseen ∑ text \x00 with bytes"
    assert one.decode(one.encode(unseen)) == unseen  # byte-level: nothing is unknown
    assert len(one.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges were learned


def test_command_writes_a_loadable_directory(tmp_path, write_jsonl):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in TEXTS])
    assert main([str(tmp_path / "tok"), "--vocab-size", "300", "--corpus", str(corpus)]) == 0
    tokenizer = Tokenizer.from_path(tmp_path / "tok")
    assert tokenizer.vocab_size == 300 and tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_id == 1
    assert tokenizer.has_chat_template
    record = json.loads((tmp_path / "tok" / "training.json").read_text())
    assert record["vocab_size"] == 300 and record["corpus"]["source"] == str(corpus)


def test_shipped_tokenizer_is_reproducible(tmp_path):
    """Retraining with the recorded command gives the shipped files, where the corpus is the same."""
    record = json.loads((DEFAULT_TOKENIZER_DIR / "training.json").read_text())
    corpus = build_stdlib_corpus(tmp_path / "corpus.jsonl", record["corpus"]["max_bytes"])
    if corpus.sha256 != record["corpus"]["sha256"]:
        pytest.skip(f"this Python's stdlib differs from the one the shipped tokenizer was trained on "
                    f"(Python {record['corpus']['python_version']})")
    assert main([str(tmp_path / "tok"), "--vocab-size", str(record["vocab_size"])]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "training.json"):
        assert (tmp_path / "tok" / name).read_bytes() == (DEFAULT_TOKENIZER_DIR / name).read_bytes(), name
