"""Gradient accumulation under sharded data parallelism reduces gradients once per step.

With 2 micro-batches per rank (train.micro_batch_size=1, global batch 4, dp_shard=2) every FSDP
unit's gradient is reduce-scattered once per step, as with 1 micro-batch (micro_batch_size=2),
not once per micro-batch; and the run still trains like one process with the same micro-batches,
also when ranks and micro-batches hold different numbers of loss tokens (SFT, answer-only loss: the
loss is normalised by the loss tokens of the whole global batch).
"""

from __future__ import annotations

import json
import random

import pytest

from tessera.config.schema import load_config
from tessera.train.data_source import build_training_data
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process
from tests.train.runs import TINY_DENSE

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


def _sft_dataset(directory) -> str:
    """Conversations whose answers range from one word to twenty: windows of 33 packed tokens hold very
    different numbers of answer tokens."""
    from tessera.data import default_tokenizer, preprocess_sft

    rng = random.Random(0)
    words = "the a model token loss rank batch layer weight value answer question".split()
    records = []
    for i in range(120):
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice([2, 12])))
        response = " ".join(rng.choice(words) for _ in range(rng.choice([1, 4, 20])))
        records.append({"prompt": f"{i}: {prompt}?", "response": response})
    (directory / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([directory / "chat.jsonl"], directory / "sft", default_tokenizer(), show_progress=False)
    return str(directory / "sft")


@pytest.mark.dist
def test_sft_unequal_loss_tokens_per_rank_train_like_one_process(tmp_path):
    dataset = _sft_dataset(tmp_path)
    steps = 3
    # Two ranks of two micro-batches of one sample each.
    extra = {"data.kind": "sft", "train.micro_batch_size": 1, "train.global_batch_size": 4,
             "train.eval_interval": steps, "data.valid_fraction": 0.2, "train.eval_steps": 2}
    one = overrides_for("dense", dataset, tmp_path / "one", steps, **extra)
    data = build_training_data(load_config(TINY_DENSE, one))
    for _ in range(steps):
        per_row = data.train.next_batch().target_mask.sum(dim=1).tolist()  # rank r reads rows 2r, 2r + 1
        assert sum(per_row[:2]) != sum(per_row[2:]), per_row  # a mean of per-rank means would differ
        assert per_row[0] != per_row[1] and per_row[2] != per_row[3], per_row  # and per micro-batch
        assert 0 < sum(per_row) < 4 * 32  # answer-only: the mask drops the prompts
    ref = train_one_process("dense", one)
    got = run_ranks(train_on_ranks, 2, "dense",
                    overrides_for("dense", dataset, tmp_path / "ranks", steps, **extra, **{"parallel.dp_shard": 2}))
    assert [r["loss_tokens"] for r in got[0]["records"]] == [r["loss_tokens"] for r in ref["records"]]
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want
