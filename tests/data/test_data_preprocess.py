import json

import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import IndexedDataset, index_paths, preprocess


def test_documents_are_tokenized_in_order_with_eos(tmp_path, tokenizer, text_corpus):
    stats = preprocess(text_corpus, tmp_path / "out", tokenizer, show_progress=False)
    ds = IndexedDataset(tmp_path / "out")
    texts = [json.loads(line)["text"] for path in text_corpus[:2] for line in path.read_text().splitlines()]
    texts.append(text_corpus[2].read_text())
    assert len(ds) == len(texts) == stats.documents == 8
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tokenizer.encode(text) + [tokenizer.eos_id]
    assert stats.tokens == ds.num_tokens and stats.files == 3 and ds.dtype == np.uint16
    assert stats.input_bytes == sum(p.stat().st_size for p in text_corpus)


def test_output_is_byte_identical_across_runs(tmp_path, tokenizer, text_corpus):
    preprocess(text_corpus, tmp_path / "one", tokenizer, show_progress=False)
    preprocess(text_corpus, tmp_path / "two", tokenizer, show_progress=True)
    for first, second in zip(index_paths(tmp_path / "one"), index_paths(tmp_path / "two")):
        assert first.read_bytes() == second.read_bytes()


def test_directory_input_line_mode_field_and_no_eos(tmp_path, tokenizer, write_jsonl):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("first line\n\nsecond line\n")
    write_jsonl(corpus / "sub" / "a.jsonl", [{"body": "from jsonl"}])
    (corpus / "ignored.csv").write_text("x,y\n")
    preprocess([corpus], tmp_path / "out", tokenizer, jsonl_field="body", text_mode="line",
               append_eos=False, show_progress=False)
    ds = IndexedDataset(tmp_path / "out")
    # sorted paths: b.txt before sub/a.jsonl; blank lines are not documents
    assert [tokenizer.decode(ds[i]) for i in range(len(ds))] == ["first line", "second line", "from jsonl"]


def test_bad_jsonl_names_file_and_line_and_keeps_existing_output(tmp_path, tokenizer, text_corpus):
    preprocess(text_corpus, tmp_path / "out", tokenizer, show_progress=False)
    before = [p.read_bytes() for p in index_paths(tmp_path / "out")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3 is not valid JSON"):
        preprocess([bad], tmp_path / "out", tokenizer, show_progress=False)
    assert [p.read_bytes() for p in index_paths(tmp_path / "out")] == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("line, message", [
    ('{"txt": "x"}', r"bad\.jsonl:1: no field 'text' \(fields present: txt\)"),
    ('{"text": 3}', r"bad\.jsonl:1: field 'text' must be a string, found int"),
    ('["text"]', r"bad\.jsonl:1: expected a JSON object, found list"),
    ('{"text": "caf\\ud800"}', r"bad\.jsonl:1: \$\.text is not valid Unicode text: character 3 is a lone surrogate"),
    ('{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}", r"bad\.jsonl:1 is nested too deeply to parse"),
])
def test_malformed_records(tmp_path, tokenizer, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    with pytest.raises(DataError, match=message):
        preprocess([bad], tmp_path / "out", tokenizer, show_progress=False)


def test_bad_inputs(tmp_path, tokenizer):
    with pytest.raises(DataError, match="input file does not exist"):
        preprocess([tmp_path / "nope.txt"], tmp_path / "out", tokenizer, show_progress=False)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported input file type '\.csv'"):
        preprocess([tmp_path / "data.csv"], tmp_path / "out", tokenizer, show_progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8 at byte 3"):
        preprocess([tmp_path / "latin1.txt"], tmp_path / "out", tokenizer, show_progress=False)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no documents found"):
        preprocess([tmp_path / "blank.jsonl"], tmp_path / "out", tokenizer, show_progress=False)
    assert not index_paths(tmp_path / "out")[1].exists()


def test_a_dataset_of_no_tokens_is_refused(tmp_path, tokenizer, write_jsonl):
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(DataError, match=r"the 2 documents of .*empty\.jsonl hold no tokens"):
        preprocess([empty], tmp_path / "out", tokenizer, append_eos=False, show_progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))]
    stats = preprocess([empty], tmp_path / "out", tokenizer, show_progress=False)  # each document: its eos
    assert stats.tokens == 2
