"""Gradient accumulation under sharded data parallelism reduces gradients once per step.

With 2 micro-batches per rank (train.micro_batch_size=1, global batch 4, dp_shard=2) every FSDP
unit's gradient is reduce-scattered once per step, as with 1 micro-batch (micro_batch_size=2),
not once per micro-batch; and the run still trains like one process with the same micro-batches.
"""

from __future__ import annotations

import pytest

from tessera.parallel.testing import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 2
FSDP2 = {"parallel.dp_shard": 2, "log.comm_stats": True}


def _reduce_scatter_calls(records: list[dict]) -> list[int]:
    return [r["comm/reduce_scatter_calls"] for r in records]


@pytest.mark.dist
def test_two_micro_batches_reduce_scatter_as_often_as_one(small_dataset, tmp_path):
    one = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path / "one", STEPS,
                                                               **FSDP2, **{"train.micro_batch_size": 2}))
    two = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path / "two", STEPS,
                                                               **FSDP2, **{"train.micro_batch_size": 1}))
    layers = 2  # tests/train/runs.py shrinks the model to 2 blocks: 2 block units + the root, on 2 ranks
    assert _reduce_scatter_calls(one[0]["records"]) == [2 * (layers + 1)] * STEPS
    assert _reduce_scatter_calls(two[0]["records"]) == _reduce_scatter_calls(one[0]["records"])
    # The forward/backward all-gathers still run per micro-batch (zero_stage 3 reshards the blocks).
    assert two[0]["records"][0]["comm/all_gather_calls"] > one[0]["records"][0]["comm/all_gather_calls"]


@pytest.mark.dist
def test_accumulated_gradients_train_like_one_process(small_dataset, tmp_path):
    mb1 = {"train.micro_batch_size": 1}
    ref = train_one_process("dense", overrides_for("dense", small_dataset, tmp_path / "ref", STEPS, **mb1))
    got = run_ranks(train_on_ranks, 2, "dense", overrides_for("dense", small_dataset, tmp_path / "ranks", STEPS,
                                                              **mb1, **{"parallel.dp_shard": 2}))
    assert_same_training(got, ref, rtol=1e-5)
