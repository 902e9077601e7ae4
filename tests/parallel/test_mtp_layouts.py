"""Multi-token prediction (model.mtp_depth) under layouts trains like one process: the MTP modules
cut like the main blocks by tensor (and sequence) parallelism, sharded by FSDP, their MoE block's
experts spread over ranks, and under pipeline parallelism on the last stage, which then holds the
embedding too (its gradient summed with the first stage's, as tied embeddings are). The logged
loss, mtp_loss and mtp_loss/{k}, gradient norms and final weights equal the one-process run's,
fp32 within 1e-5, through the real Trainer on forked gloo ranks."""

from __future__ import annotations

import pytest

from tessera.config.errors import ParallelError
from tessera.config.parallel import ParallelConfig
from tessera.config.presets import get_preset
from tessera.parallel.dims import ParallelDims
from tessera.parallel.testing import run_ranks
from tests.parallel.trainer_runs import assert_same_training, overrides_for, train_on_ranks, train_one_process

STEPS = 3
MTP = {"model.mtp_depth": 2, "model.mtp_loss_weight": 0.3}


def _assert_same_mtp_losses(got: list[dict], ref: dict, depth: int) -> None:
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        for key in ["mtp_loss", *(f"mtp_loss/{k}" for k in range(1, depth + 1))]:
            assert w[key] > 0
            assert abs(r[key] - w[key]) <= 1e-5 * w[key], (key, r[key], w[key])


@pytest.mark.dist
@pytest.mark.parametrize("model,world,parallel", [
    pytest.param("dense", 2, {"parallel.dp_shard": 2}, id="dense-fsdp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="dense-tp2"),
    pytest.param("dense", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, id="dense-tp2-sp"),
    pytest.param("dense", 2, {"parallel.pp": 2, "parallel.dp_shard": 1}, id="dense-pp2"),
    pytest.param("moe", 2, {"parallel.ep": 2, "parallel.dp_shard": 2}, id="moe-ep2-fsdp2"),
    pytest.param("deepseek", 2, {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"},
                 id="deepseek-pp2-1f1b", marks=pytest.mark.slow),
    pytest.param("deepseek", 2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
                 id="deepseek-tp2-sp", marks=pytest.mark.slow),
    pytest.param("dense", 4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1},
                 id="dense-pp2-tp2", marks=pytest.mark.slow),
])
def test_multi_token_prediction_under_a_layout_trains_like_one_process(model, world, parallel, small_dataset,
                                                                       tmp_path):
    ref = train_one_process(model, overrides_for(model, small_dataset, tmp_path / "one", STEPS, **MTP))
    got = run_ranks(train_on_ranks, world, model,
                    overrides_for(model, small_dataset, tmp_path / "ranks", STEPS, **MTP, **parallel))
    assert_same_training(got, ref, rtol=1e-5)
    _assert_same_mtp_losses(got, ref, MTP["model.mtp_depth"])
    assert any(name.startswith("mtp.2.block.") for name in ref["weights"])


def test_context_parallelism_is_refused_by_name():
    cfg = get_preset("tiny-llama", mtp_depth=1)
    dims = ParallelDims.from_config(ParallelConfig(cp=2, dp_shard=1), 2)
    with pytest.raises(ParallelError, match=r"cp=2 is invalid with model.mtp_depth=1"):
        dims.validate(cfg, 2)
    ParallelDims.from_config(ParallelConfig(cp=2, dp_shard=1), 2).validate(get_preset("tiny-llama"), 2)


def test_distillation_with_mtp_is_refused_by_name(tmp_path):
    from tessera.config.errors import ConfigError
    from tessera.config.schema import load_config
    from tests.train.runs import TINY_DENSE

    with pytest.raises(ConfigError, match=r"model.mtp_depth=1 is invalid: 0 with train.distill.teacher"):
        load_config(TINY_DENSE, [f"train.distill.teacher={tmp_path}", "model.mtp_depth=1"])
