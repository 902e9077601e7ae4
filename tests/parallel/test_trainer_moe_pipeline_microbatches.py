"""An MoE model in a pipeline with `parallel.microbatches` other than rows / train.micro_batch_size
trains, through the real Trainer, like one process whose micro-batches are the pipeline's.

The convention (Megatron-Core's, documented at `ParallelConfig.microbatches`): MoE auxiliary
losses, routing statistics and expert capacity belong to the pipeline's micro-batch, rows /
microbatches samples. So the reference is the one-process run with train.micro_batch_size of
that size: fp32 within 1e-5 relative, dropless and with capacity-based dropping alike (capacity
is computed over the same tokens). Against the run with the configured train.micro_batch_size the
balancing loss differs, which shows the micro-batch really changed.
"""

from __future__ import annotations

import pytest

from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 2}
PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}
CAPACITY = {"model.moe.capacity_factor": 1.0}


@pytest.mark.dist
@pytest.mark.parametrize("world,parallel,pipeline_micro_batch", [
    # 4 rows per step, train.micro_batch_size=2: 4 pipeline micro-batches of one row.
    pytest.param(2, {**PP2, "parallel.pp_schedule": "1f1b", "parallel.microbatches": 4}, 1, id="pp2-1f1b-m4"),
    pytest.param(2, {**PP2, "parallel.pp_schedule": "1f1b", "parallel.microbatches": 4, **CAPACITY}, 1,
                 id="pp2-1f1b-m4-capacity"),
    # GPipe takes one micro-batch of all 4 rows.
    pytest.param(2, {**PP2, "parallel.pp_schedule": "gpipe", "parallel.microbatches": 1}, 4, id="pp2-gpipe-m1",
                 marks=pytest.mark.slow),
    # dp_shard=2 leaves 2 rows per rank, cut in micro-batches of one by train.micro_batch_size; one here.
    pytest.param(4, {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "gpipe",
                     "train.micro_batch_size": 1, "parallel.microbatches": 1}, 2, id="pp2-fsdp2-gpipe-m1",
                 marks=pytest.mark.slow),
])
def test_moe_pipeline_microbatches_train_like_one_process(world, parallel, pipeline_micro_batch, small_dataset,
                                                          tmp_path):
    model_keys = {k: v for k, v in parallel.items() if k.startswith("model.")}
    ref = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "one", STEPS, **EVAL, **model_keys,
                                                 **{"train.micro_batch_size": pipeline_micro_batch}))
    got = run_ranks(train_on_ranks, world, "moe", overrides_for("moe", small_dataset, tmp_path / "ranks", STEPS,
                                                                **EVAL, **parallel))
    assert [r["step"] for r in got[0]["records"]] == [1, 2, 3]
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want
    configured = parallel.get("train.micro_batch_size", 2)
    other = train_one_process("moe", overrides_for("moe", small_dataset, tmp_path / "configured", 1, **EVAL,
                                                   **model_keys, **{"train.micro_batch_size": configured}))
    first = got[0]["records"][0]["aux/layer0/load_balancing"]
    assert abs(first - other["records"][0]["aux/layer0/load_balancing"]) > 1e-4 * first
