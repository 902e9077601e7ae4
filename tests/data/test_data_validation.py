"""Token ids are checked against the model's vocabulary when a dataset is opened for training:
a corrupt `.bin`, or one made with a larger tokenizer, fails before step 1 naming the file and
the first bad offset."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cli import main
from tessera.config.errors import DataError
from tessera.data import IndexedDataset, IndexedDatasetWriter
from tests.train.runs import TINY_DENSE, build_small_dataset, set_args, shrink


def _write(prefix, documents, dtype=np.uint16) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def test_first_bad_id_is_named_with_its_offsets(tmp_path):
    ds = _write(tmp_path / "d", [[1, 2, 3], [4, 5], [6, 300, 7, 400]])
    ds.check_token_ids(401)  # every id fits
    for chunk in (1, 2, 4, 1 << 24):  # the first bad id is found whatever chunk it falls in
        with pytest.raises(DataError, match=r"d\.bin: token id 300 at token offset 6 \(byte 12, document 2\) "
                                            r"is outside the model's vocabulary \(allowed 0\.\.255\)"):
            ds.check_token_ids(256, chunk_tokens=chunk)
    with pytest.raises(DataError, match="token id 400 at token offset 8"):
        ds.check_token_ids(301, chunk_tokens=3)


def test_a_dtype_that_cannot_hold_a_bad_id_is_not_scanned(tmp_path):
    ds = _write(tmp_path / "d", [[0, 255]], np.uint8)
    ds.tokens = None  # a scan would fail on this; the check must not need to read the file
    ds.check_token_ids(256)
    empty = _write(tmp_path / "e", [[]])
    empty.check_token_ids(8)


def test_corrupt_bytes_are_found_in_a_large_file(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=3_000_000, dtype=np.uint16)
    _write(tmp_path / "big", [tokens[:1_000_000], tokens[1_000_000:]])
    IndexedDataset(tmp_path / "big").check_token_ids(32000)
    with open(tmp_path / "big.bin", "r+b") as f:  # two bytes damaged on disk, deep into the file
        f.seek(2 * 2_500_001)
        f.write(b"\xff\xff")
    with pytest.raises(DataError, match=r"token id 65535 at token offset 2500001 \(byte 5000002, document 1\)"):
        IndexedDataset(tmp_path / "big").check_token_ids(32000, chunk_tokens=1 << 20)


@pytest.mark.slow
def test_training_on_a_corrupt_dataset_fails_before_step_1(tmp_path, capsys):
    prefix = build_small_dataset(tmp_path)
    tokens = IndexedDataset(prefix).num_tokens
    bad_offset = tokens - 5  # in the last document: the validation split, never sampled for training
    with open(prefix + ".bin", "r+b") as f:
        f.seek(2 * bad_offset)
        f.write(np.array([60000], dtype="<u2").tobytes())
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(prefix, run, 2))]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tessera train: error: ") and err.count("\n") == 1, err
    assert f"{prefix}.bin: token id 60000 at token offset {bad_offset}" in err and "Traceback" not in err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_both_stop_on_rank_0s_scan(tmp_path, capfd):
    prefix = build_small_dataset(tmp_path)
    bad_offset = IndexedDataset(prefix).num_tokens - 5
    with open(prefix + ".bin", "r+b") as f:
        f.seek(2 * bad_offset)
        f.write(np.array([60000], dtype="<u2").tobytes())
    run = tmp_path / "run"
    overrides = shrink(prefix, run, 2, **{"parallel.dp_shard": 2})
    assert main(["train", TINY_DENSE, *set_args(overrides), "--nproc", "2"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert f"[rank 0] {prefix}.bin: token id 60000 at token offset {bad_offset}" in err
    assert f"[rank 1] on rank 0: {prefix}.bin: token id 60000" in err  # rank 1 did not scan; it was told
    assert not (run / "metrics.jsonl").exists()
