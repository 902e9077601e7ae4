import io
import json

import numpy as np
import pytest
import torch

from tessera.config.errors import DataError
from tessera.data import BatchIterator, BlendedDataset, IndexedDatasetWriter, PackedDataset, eval_batches

SEQ_LEN = 4


def packed(prefix, num_samples, start=0):
    with IndexedDatasetWriter(prefix, np.uint32) as writer:
        writer.add_document(np.arange(start, start + num_samples * SEQ_LEN + 1))
    return PackedDataset(prefix, SEQ_LEN)


def sample_ids(batch):
    return (batch.tokens[:, 0] // SEQ_LEN).tolist()


def test_batches_are_whole_global_batches_with_a_full_mask(tmp_path):
    batch = BatchIterator(packed(tmp_path / "ds", 30), global_batch_size=6, seed=0).next_batch()
    assert batch.tokens.shape == (6, SEQ_LEN + 1) and batch.tokens.dtype == torch.int64
    assert batch.loss_mask.shape == (6, SEQ_LEN + 1) and batch.loss_mask.dtype == torch.bool
    assert bool(batch.loss_mask.all())
    assert torch.equal(batch.inputs, batch.tokens[:, :-1]) and torch.equal(batch.targets, batch.tokens[:, 1:])
    assert torch.equal(batch.targets[:, :-1], batch.inputs[:, 1:])


def test_each_epoch_is_a_seeded_permutation(tmp_path):
    ds = packed(tmp_path / "ds", 30)
    iterator = BatchIterator(ds, global_batch_size=5, seed=7)
    epochs = [sum((sample_ids(iterator.next_batch()) for _ in range(6)), []) for _ in range(3)]
    assert all(sorted(e) == list(range(30)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and iterator.epoch == 2
    other = BatchIterator(ds, global_batch_size=5, seed=8)
    assert sum((sample_ids(other.next_batch()) for _ in range(6)), []) != epochs[0]
    plain = BatchIterator(ds, global_batch_size=5, shuffle=False)
    assert sum((sample_ids(plain.next_batch()) for _ in range(6)), []) == list(range(30))


def test_a_batch_crossing_an_epoch_skips_nothing(tmp_path):
    iterator = BatchIterator(packed(tmp_path / "ds", 10), global_batch_size=4, seed=1)
    seen = sum((sample_ids(iterator.next_batch()) for _ in range(5)), [])  # 20 samples = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert iterator.samples_seen == 20


@pytest.mark.parametrize("blend", [False, True])
def test_resumed_iterator_sees_exactly_the_uninterrupted_batches(tmp_path, blend):
    if blend:
        dataset = BlendedDataset([packed(tmp_path / "a", 7), packed(tmp_path / "b", 20, 1000)], [0.3, 0.7],
                                 seed=5, num_samples=26)
    else:
        dataset = packed(tmp_path / "ds", 26)
    uninterrupted = BatchIterator(dataset, global_batch_size=4, seed=11)
    expected = [uninterrupted.next_batch() for _ in range(12)]  # crosses an epoch boundary
    first = BatchIterator(dataset, global_batch_size=4, seed=11)
    for _ in range(7):
        first.next_batch()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint stores it
    json.dumps(first.state_dict())  # and plain data
    buffer.seek(0)
    resumed = BatchIterator(dataset, global_batch_size=4, seed=11)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for want in expected[7:]:
        got = resumed.next_batch()
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.loss_mask, want.loss_mask)


def test_state_from_other_data_or_seed_is_refused(tmp_path):
    iterator = BatchIterator(packed(tmp_path / "ds", 20), global_batch_size=4, seed=0)
    iterator.next_batch()
    state = iterator.state_dict()
    with pytest.raises(DataError, match="saved with seed=0 but this iterator has seed=1"):
        BatchIterator(packed(tmp_path / "ds", 20), 4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="saved with num_samples=20 but this iterator has num_samples=21"):
        BatchIterator(packed(tmp_path / "other", 21), 4, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="not a batch iterator state"):
        iterator.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="global_batch_size must be at least 1"):
        BatchIterator(packed(tmp_path / "ds", 20), 0)


def test_eval_batches_cover_every_sample_once_in_order(tmp_path):
    ds = packed(tmp_path / "ds", 10)
    batches = list(eval_batches(ds, 4))
    assert [len(b.tokens) for b in batches] == [4, 4, 2]
    assert sum((sample_ids(b) for b in batches), []) == list(range(10))
    assert len(list(eval_batches(ds, 4, max_batches=2))) == 2
