"""The chunked LM-head loss under layouts: FSDP (the head's weight unsharded inside the root's
forward), expert parallelism, and tensor parallelism (where the vocabulary-parallel loss keeps
running) all train like the one-process run with the plain loss, fp32 within 1e-5."""

from __future__ import annotations

import pytest

from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
EVAL = {"train.eval_interval": STEPS, "data.valid_fraction": 0.2, "train.eval_steps": 3}
CHUNKED = {"train.loss_chunk_tokens": 24}  # micro-batches of 64 tokens: chunks of 24, 24 and 16


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2", marks=pytest.mark.slow),
])
def test_chunked_loss_layout_trains_like_one_process(model, world, parallel, small_dataset, tmp_path):
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **EVAL))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "ranks", STEPS, **EVAL, **parallel, **CHUNKED))
    assert_same_training(got, ref, rtol=1e-5)
    val, want = got[0]["records"][-1]["val_loss"], ref["records"][-1]["val_loss"]
    assert abs(val - want) <= 1e-5 * want
