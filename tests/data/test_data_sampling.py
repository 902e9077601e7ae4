import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import IndexedDatasetWriter, PackedDataset, build_split_dataset


def make_dataset(prefix, lengths, start=0):
    """Documents of consecutive ids, so that the stream is start, start + 1, ..."""
    with IndexedDatasetWriter(prefix, np.uint32) as writer:
        position = start
        for length in lengths:
            writer.add_document(np.arange(position, position + length))
            position += length
    return prefix


def test_samples_are_consecutive_windows_across_documents(tmp_path):
    prefix = make_dataset(tmp_path / "ds", [5, 1, 7, 3, 9])  # 25 tokens: ids 0..24
    ds = PackedDataset(prefix, seq_len=4)
    assert len(ds) == (25 - 1) // 4 == 6
    for i in range(len(ds)):
        tokens, mask = ds[i]
        assert tokens.dtype == np.int64 and mask is None
        assert tokens.tolist() == list(range(4 * i, 4 * i + 5))  # seq_len + 1, sharing one token
    with pytest.raises(IndexError):
        ds[6]


def test_train_valid_split_is_disjoint_and_covers_the_stream(tmp_path):
    prefix = make_dataset(tmp_path / "ds", [40, 61])  # 101 tokens -> 25 samples of seq_len 4
    train = PackedDataset(prefix, 4, split="train", valid_fraction=0.2)
    valid = PackedDataset(prefix, 4, split="valid", valid_fraction=0.2)
    assert (len(train), len(valid)) == (20, 5)
    starts = [train[i].tokens[0] for i in range(20)] + [valid[i].tokens[0] for i in range(5)]
    assert starts == list(range(0, 100, 4))
    assert valid[4].tokens[-1] == 100
    assert len(PackedDataset(prefix, 4, split="valid", valid_fraction=0.01)) == 1  # at least one
    assert len(PackedDataset(prefix, 4, split="train")) == 25 and len(PackedDataset(prefix, 4, split="valid")) == 0


def test_bad_arguments_raise_data_error(tmp_path):
    prefix = make_dataset(tmp_path / "ds", [10])
    with pytest.raises(DataError, match="10 tokens are fewer than one sample of seq_len \\+ 1 = 17"):
        PackedDataset(prefix, 16)
    with pytest.raises(DataError, match="split 'test' is not allowed"):
        PackedDataset(prefix, 4, split="test")
    with pytest.raises(DataError, match="valid_fraction must be in"):
        PackedDataset(prefix, 4, valid_fraction=1.0)
    with pytest.raises(DataError, match="too few for a validation fraction"):
        PackedDataset(make_dataset(tmp_path / "one", [6]), 4, valid_fraction=0.5)


def test_build_split_dataset_single_and_blended(tmp_path):
    a = make_dataset(tmp_path / "a", [41])
    b = make_dataset(tmp_path / "b", [81], start=1000)
    single = build_split_dataset([a], 4, "train")
    assert isinstance(single, PackedDataset) and len(single) == 10
    blended = build_split_dataset([a, b], 4, "valid", valid_fraction=0.25, seed=1)
    origins = [blended[i].tokens[0] >= 1000 for i in range(len(blended))]
    assert len(blended) == 3 + 5 and sum(origins) == 5  # proportional to their sizes by default
