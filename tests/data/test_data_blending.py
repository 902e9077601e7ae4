import numpy as np
import pytest

from tessera.config.errors import DataError
from tessera.data import BlendedDataset, IndexedDatasetWriter, PackedDataset, blend_schedule


def max_share_error(weights, schedule):
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    n = np.arange(1, len(schedule) + 1)[:, None]
    counts = np.cumsum(schedule[:, None] == np.arange(len(w))[None, :], axis=0)
    return np.abs(counts - w[None, :] * n).max()


@pytest.mark.parametrize("weights", [[0.5, 0.5], [3, 1], [0.7, 0.2, 0.1], [0.001, 0.999], [1, 0, 2],
                                     [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]])
def test_every_prefix_is_within_one_of_its_share(weights):
    schedule = blend_schedule(weights, 2000)
    assert max_share_error(weights, schedule) < 1 - 1e-9


def test_random_weights_keep_the_quota_property():
    rng = np.random.default_rng(0)
    for _ in range(30):
        k = int(rng.integers(2, 7))
        weights = [int(x * 10_000) + 1 for x in rng.random(k) ** 3]  # exact: 1e-9 is visible
        assert max_share_error(weights, blend_schedule(weights, 1500)) < 1 - 1e-9, weights


def test_schedule_is_deterministic_and_exact():
    assert blend_schedule([3, 1], 8).tolist() == blend_schedule([0.75, 0.25], 8).tolist()
    assert np.bincount(blend_schedule([3, 1], 8)).tolist() == [6, 2]
    assert 2 not in blend_schedule([1, 1, 0], 100)


def packed(prefix, start, count, seq_len=4):
    with IndexedDatasetWriter(prefix, np.uint32) as writer:
        writer.add_document(np.arange(start, start + count * seq_len + 1))
    return PackedDataset(prefix, seq_len)


def test_blended_dataset_draws_from_components_in_seeded_passes(tmp_path):
    small, large = packed(tmp_path / "s", 0, 5), packed(tmp_path / "l", 10_000, 50)
    blended = BlendedDataset([small, large], [0.5, 0.5], seed=3, num_samples=40)
    firsts = [int(blended[i].tokens[0]) for i in range(40)]
    from_small = [t // 4 for t in firsts if t < 10_000]
    assert len(from_small) == 20  # the small dataset is repeated: 4 passes of its 5 samples
    for p in range(4):
        assert sorted(from_small[5 * p:5 * p + 5]) == [0, 1, 2, 3, 4]
    assert from_small[:5] != from_small[5:10] or from_small[5:10] != from_small[10:15]
    from_large = [(t - 10_000) // 4 for t in firsts if t >= 10_000]
    assert len(set(from_large)) == 20  # no repeats within a pass
    again = BlendedDataset([small, large], [0.5, 0.5], seed=3, num_samples=40)
    assert [int(again[i].tokens[0]) for i in range(40)] == firsts
    other = BlendedDataset([small, large], [0.5, 0.5], seed=4, num_samples=40)
    assert [int(other[i].tokens[0]) for i in range(40)] != firsts
    # By default one blended epoch shows every sample of every dataset at least once.
    assert len(BlendedDataset([small, large], [5, 50])) == 55
    even = BlendedDataset([small, large], [1, 1])
    assert len(even) == 100 and sorted({int(even[i].tokens[0]) for i in range(100)} - set(range(20))) == \
        list(range(10_000, 10_200, 4))


def test_blending_errors(tmp_path):
    a = packed(tmp_path / "a", 0, 5)
    with pytest.raises(DataError, match="one weight per dataset"):
        BlendedDataset([a], [0.5, 0.5])
    with pytest.raises(DataError, match="non-negative with a positive sum"):
        BlendedDataset([a, a], [1, -1])
    with pytest.raises(DataError, match="must share seq_len"):
        BlendedDataset([a, packed(tmp_path / "b", 0, 5, seq_len=8)], [1, 1])
