import json
import os
from pathlib import Path

from tessera.data import (
    IndexedDataset,
    Tokenizer,
    build_stdlib_corpus,
    index_paths,
    prepare_corpus_dataset,
    select_stdlib_files,
)
from tessera.data.corpus import stdlib_root
from tessera.data.train_tokenizer import train_bpe_tokenizer


def test_selection_is_sorted_capped_and_skips_tests():
    root = stdlib_root()
    files = select_stdlib_files(300_000)
    relative = [p.relative_to(root).as_posix() for p in files]
    assert relative == sorted(relative) and len(files) > 5
    assert sum(p.stat().st_size for p in files) <= 300_000
    assert not any({"test", "tests", "site-packages", "idle_test"} & set(Path(r).parts) for r in relative)
    bigger = select_stdlib_files(600_000)
    assert bigger[:len(files)] == files and len(bigger) > len(files)


def test_selection_rules_on_a_tree_of_our_own(tmp_path):
    for name, text in {"b.py": "b = 1\n", "a/z.py": "z = 2\n", "test/t.py": "t\n", "a/tests/u.py": "u\n",
                       "site-packages/p.py": "p\n", "c.txt": "not python\n", "d.py": "d = 44444\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "latin.py").write_bytes("x = 'café'\n".encode("latin-1"))
    assert [p.relative_to(tmp_path).as_posix() for p in select_stdlib_files(100, tmp_path)] == \
        ["a/z.py", "b.py", "d.py", "latin.py"]
    assert [p.name for p in select_stdlib_files(15, tmp_path)] == ["z.py", "b.py"]  # stops at the cap
    stats = build_stdlib_corpus(tmp_path / "out" / "corpus.jsonl", 100, tmp_path)
    records = [json.loads(line) for line in Path(stats.path).read_text().splitlines()]
    assert records == [{"id": "a/z.py", "text": "z = 2\n"}, {"id": "b.py", "text": "b = 1\n"},
                       {"id": "d.py", "text": "d = 44444\n"}]  # the latin-1 file is left out
    assert stats.documents == 3


def test_corpus_is_deterministic_real_text(tmp_path):
    one = build_stdlib_corpus(tmp_path / "one.jsonl", 200_000)
    two = build_stdlib_corpus(tmp_path / "two.jsonl", 200_000)
    assert Path(one.path).read_bytes() == Path(two.path).read_bytes() and one.sha256 == two.sha256
    first = json.loads(Path(one.path).read_text().splitlines()[0])
    assert first["text"] == (stdlib_root() / first["id"]).read_text(encoding="utf-8")
    assert one.text_bytes == sum(p.stat().st_size for p in select_stdlib_files(200_000))
    assert one.documents == len(select_stdlib_files(200_000)) > 5


def test_prepare_corpus_dataset_is_idempotent_and_recovers(tmp_path, tokenizer):
    cache = tmp_path / "cache"
    prefix = prepare_corpus_dataset(cache, tokenizer, max_bytes=60_000)
    ds = IndexedDataset(prefix)
    corpus = [json.loads(line) for line in next(cache.glob("*.jsonl")).read_text().splitlines()]
    assert len(ds) == len(corpus)
    assert tokenizer.decode(ds[0][:-1]) == corpus[0]["text"] and ds[0][-1] == tokenizer.eos_id
    stamps = [os.stat(p).st_mtime_ns for p in index_paths(prefix)]
    assert prepare_corpus_dataset(cache, tokenizer, max_bytes=60_000) == prefix
    assert [os.stat(p).st_mtime_ns for p in index_paths(prefix)] == stamps  # reused, not rebuilt
    index_paths(prefix)[1].unlink()  # as if interrupted between the two renames
    assert prepare_corpus_dataset(cache, tokenizer, max_bytes=60_000) == prefix
    assert IndexedDataset(prefix).offsets.tolist() == ds.offsets.tolist()
    other = Tokenizer(train_bpe_tokenizer([c["text"] for c in corpus], vocab_size=300).backend,
                      eos_token="<|endoftext|>")
    assert prepare_corpus_dataset(cache, other, max_bytes=60_000) != prefix
