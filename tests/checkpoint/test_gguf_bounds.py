"""GGUF metadata is bounded by the file's own size before gguf's reader (or transformers) walks it:
a declared count the file cannot hold is one ConfigError naming the key, at once, never minutes of
work and gigabytes of memory; special token ids outside the vocabulary are refused by name. (The
test's own time limit is the hang guard: without the bounds the first cases loop 10^9 times.)"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tessera.checkpoint.gguf import GGUFFile, gguf_tokenizer, load_gguf
from tessera.checkpoint.gguf import header as gguf_header
from tessera.checkpoint.loading import load_model
from tessera.config.errors import ConfigError
from tests.checkpoint import gguf_files
from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

UINT32, STRING, ARRAY = 4, 8, 9


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _entry(key: str, kind: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + value


def _array(item: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item, count) + items


def _file(tmp_path: Path, *entries: bytes, tensors: int = 0, name: str = "crafted.gguf") -> Path:
    """A GGUF (version 3) file of `entries` metadata and `tensors` declared tensors (none written)."""
    path = tmp_path / name
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, len(entries)) + b"".join(entries))
    return path


def _refused(path: Path, fragment: str) -> None:
    for read in (GGUFFile.open, load_model, gguf_tokenizer):
        with pytest.raises(ConfigError, match=fragment) as e:
            read(path)
        assert "\n" not in str(e.value)


def test_an_array_of_a_billion_items_in_a_small_file_is_refused_naming_the_key(tmp_path):
    arch = _entry("general.architecture", STRING, _string("llama"))
    huge = _entry("llama.rope.dimension_sections", ARRAY, _array(UINT32, 10**9, b"\0" * 64))
    _refused(_file(tmp_path, arch, huge),
             r"GGUF metadata 'llama.rope.dimension_sections' declares 1,000,000,000 array items")


def test_a_million_entry_token_list_in_a_small_file_is_refused_naming_the_key(tmp_path):
    tokens = _entry("tokenizer.ggml.tokens", ARRAY, _array(STRING, 10**6, _string("a") * 100))
    _refused(_file(tmp_path, _entry("general.architecture", STRING, _string("llama")), tokens),
             r"'tokenizer.ggml.tokens' declares 1,000,000 items of at least 8 bytes each, more than the \d+ bytes left")


@pytest.mark.parametrize("entries, tensors, fragment", [
    ([_entry("k", STRING, struct.pack("<Q", 2**40) + b"abc")], 0,
     r"GGUF metadata 'k' \(a string\) needs 1099511627776 bytes"),
    ([_entry("k", ARRAY, _array(STRING, 3, _string("a") + struct.pack("<Q", 2**40) + b"\0" * 16))], 0,
     "'k' holds strings that run past the end of the file"),
    ([_entry("k", ARRAY, _array(ARRAY, 1, _array(ARRAY, 1, _array(UINT32, 0))))], 0, "'k' nests arrays more than 2"),
    ([_entry("k", 13, b"\0" * 8)], 0, "'k' has value type 13, which GGUF does not define"),
    ([_entry("k", ARRAY, _array(13, 1, b"\0" * 8))], 0, "'k' is an array of value type 13"),
    ([], 10**12, "the GGUF header's tensor count declares 1,000,000,000,000 items of at least 24 bytes"),
    ([struct.pack("<Q", 2**40) + b"\0" * 24], 1, r"GGUF tensor #0 \(a string of 1099511627776 bytes\) needs"),
    ([_string("kkkk") + b"\0"], 0, r"GGUF metadata 'kkkk' needs 4 bytes, but only 1 are left in the file"),
])
def test_every_count_and_type_is_checked_against_the_file(tmp_path, entries, tensors, fragment):
    path = _file(tmp_path, *entries, tensors=tensors)
    if tensors:  # the "entries" are tensor infos
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, 0) + b"".join(entries))
    with pytest.raises(ConfigError, match=fragment):
        gguf_header.read_metadata(path)


def test_the_metadata_count_and_tensor_dims_are_bounded_too(tmp_path):
    path = tmp_path / "entries.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 10**15) + b"\0" * 100)
    with pytest.raises(ConfigError, match=r"metadata count declares 1,000,000,000,000,000 items of at least 13 bytes"):
        GGUFFile.open(path)
    dims = _string("t") + struct.pack("<I", 1000) + b"\0" * 8000
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + dims)
    with pytest.raises(ConfigError, match="GGUF tensor #0 declares 1000 dimensions; GGML tensors have at most 4"):
        GGUFFile.open(path)


def test_arrays_past_the_item_bound_are_refused_even_when_the_file_holds_them(tmp_path, monkeypatch):
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf", ("F32",))
    monkeypatch.setattr(gguf_header, "MAX_ARRAY_ITEMS", 4000)  # the file's token list has 4096
    with pytest.raises(ConfigError, match="'tokenizer.ggml.tokens' declares 4,096 array items; Tessera reads at most"):
        GGUFFile.open(path)


def test_a_real_file_walks_to_its_scalars_and_array_lengths(tmp_path):
    meta = gguf_header.read_metadata(write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf", ("F32",)))
    assert meta.array_lengths["tokenizer.ggml.tokens"] == 4096 and meta.scalars["tokenizer.ggml.eos_token_id"] == 0
    assert meta.scalars["llama.block_count"] == 2


def test_special_token_ids_outside_the_vocabulary_are_refused_naming_the_key(tmp_path, monkeypatch):
    import gguf

    def eos(value):
        monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id",
                            lambda self, _: self.add_uint32("tokenizer.ggml.eos_token_id", value))
        return write_gguf(tiny_hf_model("llama"), tmp_path / f"eos-{value}.gguf", ("F32",))

    _refused(eos(10**9), r"'tokenizer.ggml.eos_token_id' is 1000000000, outside the vocabulary of 4096 tokens")
    assert load_gguf(eos(4095)).cfg.vocab_size == 4096
    # without a token list the model's vocabulary (llama.vocab_size) bounds it
    monkeypatch.setattr(gguf_files, "_tokenizer_metadata",
                        lambda w: w.add_uint32("tokenizer.ggml.eos_token_id", 10**9))
    bare = write_gguf(tiny_hf_model("llama"), tmp_path / "bare.gguf", ("F32",))
    with pytest.raises(ConfigError, match=r"'tokenizer.ggml.eos_token_id' is 1000000000, outside the model's "
                                          "vocabulary of 4096 tokens"):
        load_gguf(bare)
