"""A checkpoint written under one layout resumes under another (DCP reshards model and optimizer
state; the trainer state is layout-independent), continuing with the losses of an uninterrupted
one-process run (fp32, 1e-5 relative; AdamW eps 1e-3 as in every equality test, see
trainer_runs.py)."""

from __future__ import annotations

import json

import pytest

from tessera.checkpoint.dcp import store as ckpt
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

FSDP4 = {"parallel.dp_shard": 4}
TP2_PP2 = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp_shard": 1}
ONE_ROW = {"train.micro_batch_size": 1}  # dp=4 reads one row per rank; pp=2 gets four micro-batches


@pytest.mark.dist
@pytest.mark.parametrize("model,first,second", [
    pytest.param("dense", FSDP4, TP2_PP2, id="dense-fsdp4-to-tp2xpp2"),
    pytest.param("dense", TP2_PP2, FSDP4, id="dense-tp2xpp2-to-fsdp4"),
    pytest.param("moe", {"parallel.dp_shard": 4, "parallel.ep": 2}, TP2_PP2, id="moe-fsdp4xep2-to-tp2xpp2",
                 marks=pytest.mark.slow),
])
def test_resume_under_another_layout(model, first, second, small_dataset, tmp_path):
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "reference", 4, **ONE_ROW))
    run = tmp_path / "run"
    saved = run_ranks(train_on_ranks, 4, model, overrides_for(model, small_dataset, run, 2, **ONE_ROW, **first))
    latest = ckpt.find_latest(run / "checkpoints")
    stored = ckpt.checkpoint_tensor_shapes(latest)
    assert {"trainer", "rng.rank0", "rng.rank3"} <= set(stored)  # layout-independent state once, RNG per rank
    assert ckpt.read_meta(latest)["layout"]["world_size"] == 4
    assert [r["step"] for r in saved[0]["records"]] == [1, 2]

    resumed = run_ranks(train_on_ranks, 4, model, overrides_for(model, small_dataset, run, 4, **ONE_ROW, **second),
                        resume=True)
    assert resumed[0]["start_step"] == 2
    assert_same_training(resumed, {"records": ref["records"][2:], "weights": ref["weights"]}, rtol=1e-5)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # one file for the whole run, written by rank 0
