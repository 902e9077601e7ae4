import pickle

import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import IndexedDataset, IndexedDatasetWriter, index_paths, token_dtype

DOCS = [[5, 6, 7], [], [8], [9, 10, 11, 12]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def test_round_trip_documents_and_stream(tmp_path):
    ds = write(tmp_path / "ds")
    assert len(ds) == 4 and ds.num_tokens == 8 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds[-1].tolist() == [9, 10, 11, 12]
    assert ds.get(1, 5).tolist() == [6, 7, 8, 9, 10]  # spans the empty and the one-token document
    assert ds.document_lengths.tolist() == [3, 0, 1, 4]
    with pytest.raises(IndexError):
        ds.get(5, 4)
    with pytest.raises(IndexError):
        ds[4]


def test_file_layout_is_the_documented_one(tmp_path):
    write(tmp_path / "ds")
    bin_path, idx_path = index_paths(tmp_path / "ds")
    assert np.fromfile(bin_path, dtype="<u2").tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    raw = idx_path.read_bytes()
    assert raw[:8] == b"TSRIDX\x00\x00"
    assert np.frombuffer(raw[8:16], "<u4").tolist() == [1, 2]  # version 1, dtype code 2 = uint16
    assert np.frombuffer(raw[16:24], "<u8").tolist() == [4]
    assert np.frombuffer(raw[24:], "<i8").tolist() == [0, 3, 3, 4, 8]


def test_dtype_follows_vocabulary_size(tmp_path):
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(151936) == np.uint32
    ds = write(tmp_path / "wide", [[70000, 1]], dtype=token_dtype(151936))
    assert ds.dtype == np.uint32 and ds[0].tolist() == [70000, 1]
    with pytest.raises(DataError, match="does not fit uint16"):
        write(tmp_path / "narrow", [[70000]])
    assert not index_paths(tmp_path / "narrow")[1].exists()


def test_missing_index_names_the_file(tmp_path):
    write(tmp_path / "ds")
    index_paths(tmp_path / "ds")[1].unlink()
    with pytest.raises(DataError, match=r"ds\.idx: index file is missing"):
        IndexedDataset(tmp_path / "ds")


def test_missing_bin_names_the_file(tmp_path):
    write(tmp_path / "ds")
    index_paths(tmp_path / "ds")[0].unlink()
    with pytest.raises(DataError, match=r"ds\.bin: token file is missing"):
        IndexedDataset(tmp_path / "ds")


def test_truncated_bin_gives_expected_and_actual_sizes(tmp_path):
    write(tmp_path / "ds")
    bin_path = index_paths(tmp_path / "ds")[0]
    bin_path.write_bytes(bin_path.read_bytes()[:11])
    with pytest.raises(DataError) as info:
        IndexedDataset(tmp_path / "ds")
    message = str(info.value)
    assert str(bin_path) in message and "truncated" in message
    assert "expected 16 bytes" in message and "found 11 bytes" in message
    assert "\n" not in message


def test_bad_magic_and_truncated_index(tmp_path):
    write(tmp_path / "ds")
    idx_path = index_paths(tmp_path / "ds")[1]
    good = idx_path.read_bytes()
    idx_path.write_bytes(b"GARBAGE!" + good[8:])
    with pytest.raises(DataError, match="not a Tessera index"):
        IndexedDataset(tmp_path / "ds")
    idx_path.write_bytes(good[:-8])
    with pytest.raises(DataError, match="index size 56 bytes does not match its header: expected 64"):
        IndexedDataset(tmp_path / "ds")
    idx_path.write_bytes(good[:10])
    with pytest.raises(DataError, match="truncated index"):
        IndexedDataset(tmp_path / "ds")


def test_failed_write_leaves_existing_dataset_untouched(tmp_path):
    write(tmp_path / "ds")
    before = [p.read_bytes() for p in index_paths(tmp_path / "ds")]
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert [p.read_bytes() for p in index_paths(tmp_path / "ds")] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]  # no temporary left


def test_empty_dataset_and_pickling(tmp_path):
    empty = write(tmp_path / "empty", [])
    assert len(empty) == 0 and empty.num_tokens == 0
    ds = write(tmp_path / "ds")
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 200  # pickled by prefix, not by contents
    assert clone.get(0, 8).tolist() == ds.get(0, 8).tolist()
